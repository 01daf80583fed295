"""Reference throughput for the DeepSeek-V3 and GPT-OSS architectures, trained by plain PyTorch on the same GPU.

Run it in the same command on the GPU machine as our pretrain_gpt on the same shapes (bench/arch_gpu.sh), so both
figures share one machine. bf16 autocast (fp32 master weights), fused AdamW, with and without torch.compile; random
tokens; dropless MoE with the experts as grouped GEMMs (torch._grouped_mm), no aux loss.

  deepseek: multi-latent attention (q and kv low-rank projections with their RMSNorms, the decoupled RoPE key shared
            by the heads, qk head 192 / v head 128 through SDPA), a dense first layer, then MoE layers with sigmoid
            scores, the expert bias in the choice, group-limited top-k, the scaling factor and one shared expert.
  gptoss:   attention with biases, learned sinks (out = out0 * sigmoid(lse0 - sink), the attention's log-sum-exp
            from flex_attention) and a 128-token sliding window on even layers; a router with a bias, top-k then
            softmax; experts with biases and GPT-OSS's clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 * gate)).

  python3 pytorch_arch_reference.py --preset deepseek-small [--modes eager,compile]

Prints one JSON line per mode: tokens/s, step time, peak memory, and the FLOPs of the ACTIVE parameters as Megatron
counts them (6 * active matmul parameters + the attention's 6 * L * s * heads * (qk + v) / 2 causal term, the
window's share for windowed layers); MFU against 989 TFLOP/s.
"""
import argparse, json, math, time
import torch
import torch.nn as nn
import torch.nn.functional as F

PEAK = 989e12
DEVICE = "cuda"
PRESETS = {
    # layers, hidden, heads, q_lora, kv_lora, qk_nope, qk_rope, v, experts, topk, groups, group_topk, moe_ffn,
    # dense_ffn, seq, mbs, vocab (DeepSeek-V2-Lite-like widths, V3's routing)
    "deepseek-small": dict(arch="deepseek", L=6, h=2048, nh=16, q_lora=768, kv_lora=512, nope=128, rope=64, v=128,
                           E=64, k=6, groups=8, group_topk=3, f=1024, dense_f=8192, S=4096, mbs=1, V=32000,
                           scale=2.5),
    # layers, hidden, heads, kv heads, head dim, experts, topk, ffn, window, seq, mbs, vocab (GPT-OSS-20B widths,
    # fewer layers and experts)
    "deepseek-tiny": dict(arch="deepseek", L=2, h=64, nh=4, q_lora=32, kv_lora=24, nope=16, rope=8, v=16, E=8, k=2,
                          groups=4, group_topk=2, f=48, dense_f=96, S=128, mbs=2, V=512, scale=2.5),
    "gptoss-tiny": dict(arch="gptoss", L=2, h=64, nh=4, kv=2, hd=16, E=4, k=2, f=48, window=8, S=128, mbs=2, V=512),
    "gptoss-small": dict(arch="gptoss", L=6, h=2880, nh=64, kv=8, hd=64, E=32, k=4, f=2880, window=128, S=4096,
                         mbs=1, V=32000),
}


def yarn_free_rope(x, cos, sin):  # rotate-half RoPE on the last dim
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_tables(S, d, theta=10000.0):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    fr = torch.outer(torch.arange(S).float(), inv)
    fr = torch.cat((fr, fr), dim=-1)
    return fr.cos()[None, None], fr.sin()[None, None]


def grouped_experts(x, idx, w, w13, w2, b13=None, b2=None, act="swiglu"):
    """x [T, h]; idx/w [T, k]; w13 [E, h, 2f] ([gate | up]); w2 [E, f, h]: the weighted sum of each token's experts."""
    T, h = x.shape
    E, k = w13.shape[0], idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    src = order // k
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[src].to(torch.bfloat16)
    g = torch._grouped_mm(xs, w13.to(torch.bfloat16), offs=offs)
    if b13 is not None:
        g = g + b13.to(g.dtype)[flat[order]]
    a, b = g.chunk(2, dim=-1)
    if act == "swiglu":
        y = F.silu(a) * b
    else:  # GPT-OSS: clamped, quick-GeLU gate, (up + 1)
        a = a.clamp(max=7.0)
        b = b.clamp(-7.0, 7.0)
        y = (b + 1) * (a * torch.sigmoid(1.702 * a))
    y = torch._grouped_mm(y.to(torch.bfloat16), w2.to(torch.bfloat16), offs=offs)
    if b2 is not None:
        y = y + b2.to(y.dtype)[flat[order]]
    y = y * w.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
    return torch.zeros(T, h, dtype=y.dtype, device=x.device).index_add_(0, src, y)


class SwiGLU(nn.Module):
    def __init__(s, h, f):
        super().__init__()
        s.fc1 = nn.Linear(h, 2 * f, bias=False)
        s.fc2 = nn.Linear(f, h, bias=False)

    def forward(s, x):
        a, b = s.fc1(x).chunk(2, dim=-1)
        return s.fc2(F.silu(a) * b)


# ---- DeepSeek-V3 ----------------------------------------------------------------------------------------------
class MLA(nn.Module):
    def __init__(s, c):
        super().__init__()
        s.c = c
        h, nh = c["h"], c["nh"]
        s.q_a = nn.Linear(h, c["q_lora"], bias=False)
        s.q_norm = nn.RMSNorm(c["q_lora"], eps=1e-6)
        s.q_b = nn.Linear(c["q_lora"], nh * (c["nope"] + c["rope"]), bias=False)
        s.kv_a = nn.Linear(h, c["kv_lora"] + c["rope"], bias=False)
        s.kv_norm = nn.RMSNorm(c["kv_lora"], eps=1e-6)
        s.kv_b = nn.Linear(c["kv_lora"], nh * (c["nope"] + c["v"]), bias=False)
        s.o = nn.Linear(nh * c["v"], h, bias=False)

    def forward(s, x, cos, sin):
        c = s.c
        B, T, _ = x.shape
        nh, nope, rope, v = c["nh"], c["nope"], c["rope"], c["v"]
        q = s.q_b(s.q_norm(s.q_a(x))).view(B, T, nh, nope + rope).transpose(1, 2)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        ckv, k_pe = s.kv_a(x).split([c["kv_lora"], rope], dim=-1)
        kv = s.kv_b(s.kv_norm(ckv)).view(B, T, nh, nope + v).transpose(1, 2)
        k_nope, val = kv.split([nope, v], dim=-1)
        k_pe = yarn_free_rope(k_pe.view(B, 1, T, rope), cos, sin).expand(B, nh, T, rope)
        q = torch.cat((q_nope, yarn_free_rope(q_pe, cos, sin)), dim=-1)
        k = torch.cat((k_nope, k_pe), dim=-1)
        y = F.scaled_dot_product_attention(q, k, val, is_causal=True, scale=(nope + rope) ** -0.5)
        return s.o(y.transpose(1, 2).reshape(B, T, nh * v))


class DeepSeekMoE(nn.Module):
    def __init__(s, c):
        super().__init__()
        s.c = c
        h, E, f = c["h"], c["E"], c["f"]
        s.router = nn.Linear(h, E, bias=False)
        s.register_buffer("bias", torch.randn(E) * 1e-3)  # the expert bias (aux-loss-free balancing), not trained
        s.w13 = nn.Parameter(torch.randn(E, h, 2 * f) * 0.02)
        s.w2 = nn.Parameter(torch.randn(E, f, h) * 0.02)
        s.shared = SwiGLU(h, f)

    def forward(s, x):
        c = s.c
        T = x.shape[0]
        E, k, G, gk = c["E"], c["k"], c["groups"], c["group_topk"]
        scores = torch.sigmoid(s.router(x).float())
        choice = scores + s.bias
        group_scores = choice.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(gk, dim=-1).indices, 1.0)
        masked = choice.masked_fill(keep.repeat_interleave(E // G, dim=1) == 0, float("-inf"))
        idx = masked.topk(k, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * c["scale"]
        return grouped_experts(x, idx, w, s.w13, s.w2) + s.shared(x).to(torch.bfloat16)


class DeepSeekBlock(nn.Module):
    def __init__(s, c, dense):
        super().__init__()
        s.n1, s.n2 = nn.RMSNorm(c["h"], eps=1e-6), nn.RMSNorm(c["h"], eps=1e-6)
        s.attn = MLA(c)
        s.mlp = SwiGLU(c["h"], c["dense_f"]) if dense else DeepSeekMoE(c)
        s.dense = dense

    def forward(s, x, cos, sin):
        B, T, C = x.shape
        x = x + s.attn(s.n1(x), cos, sin)
        y = s.n2(x)
        y = s.mlp(y) if s.dense else s.mlp(y.reshape(B * T, C)).reshape(B, T, C)
        return x + y.to(x.dtype)


# ---- GPT-OSS --------------------------------------------------------------------------------------------------
class SinkAttention(nn.Module):
    def __init__(s, c, window):
        super().__init__()
        s.c, s.window = c, window
        h, nh, kv, hd = c["h"], c["nh"], c["kv"], c["hd"]
        s.qkv = nn.Linear(h, (nh + 2 * kv) * hd, bias=True)
        s.o = nn.Linear(nh * hd, h, bias=True)
        s.sinks = nn.Parameter(torch.zeros(nh))
        from torch.nn.attention.flex_attention import create_block_mask
        S, w = c["S"], window
        mask = (lambda b, hh, qi, ki: (ki <= qi) & (qi - ki < w)) if w else (lambda b, hh, qi, ki: ki <= qi)
        s.block_mask = create_block_mask(mask, None, None, S, S, device=DEVICE)

    def forward(s, x, cos, sin):
        from torch.nn.attention.flex_attention import flex_attention
        c = s.c
        B, T, _ = x.shape
        nh, kv, hd = c["nh"], c["kv"], c["hd"]
        q, k, v = s.qkv(x).split([nh * hd, kv * hd, kv * hd], dim=-1)
        q = yarn_free_rope(q.view(B, T, nh, hd).transpose(1, 2), cos, sin)
        k = yarn_free_rope(k.view(B, T, kv, hd).transpose(1, 2), cos, sin)
        v = v.view(B, T, kv, hd).transpose(1, 2)
        out, lse = flex_attention(q, k, v, block_mask=s.block_mask, enable_gqa=True, return_lse=True)
        # The sink's logit joins the denominator: out * e^lse / (e^lse + e^sink).
        f = torch.sigmoid(lse.float() - s.sinks.float().view(1, nh, 1)).unsqueeze(-1).to(out.dtype)
        return s.o((out * f).transpose(1, 2).reshape(B, T, nh * hd))


class GptOssMoE(nn.Module):
    def __init__(s, c):
        super().__init__()
        s.c = c
        h, E, f = c["h"], c["E"], c["f"]
        s.router = nn.Linear(h, E, bias=True)
        s.w13 = nn.Parameter(torch.randn(E, h, 2 * f) * 0.02)
        s.b13 = nn.Parameter(torch.zeros(E, 2 * f))
        s.w2 = nn.Parameter(torch.randn(E, f, h) * 0.02)
        s.b2 = nn.Parameter(torch.zeros(E, h))

    def forward(s, x):
        top, idx = torch.topk(s.router(x).float(), s.c["k"], dim=-1)
        return grouped_experts(x, idx, torch.softmax(top, dim=-1), s.w13, s.w2, s.b13, s.b2, act="clamped")


class GptOssBlock(nn.Module):
    def __init__(s, c, window):
        super().__init__()
        s.n1, s.n2 = nn.RMSNorm(c["h"], eps=1e-5), nn.RMSNorm(c["h"], eps=1e-5)
        s.attn = SinkAttention(c, window)
        s.moe = GptOssMoE(c)

    def forward(s, x, cos, sin):
        B, T, C = x.shape
        x = x + s.attn(s.n1(x), cos, sin)
        return x + s.moe(s.n2(x).reshape(B * T, C)).reshape(B, T, C).to(x.dtype)


class Model(nn.Module):
    def __init__(s, c):
        super().__init__()
        s.emb = nn.Embedding(c["V"], c["h"])
        if c["arch"] == "deepseek":
            s.blocks = nn.ModuleList(DeepSeekBlock(c, dense=(i == 0)) for i in range(c["L"]))
            cos, sin = rope_tables(c["S"], c["rope"])
        else:
            s.blocks = nn.ModuleList(GptOssBlock(c, c["window"] if i % 2 == 0 else 0) for i in range(c["L"]))
            cos, sin = rope_tables(c["S"], c["hd"], 150000.0)
        s.norm = nn.RMSNorm(c["h"], eps=1e-5)
        s.out = nn.Linear(c["h"], c["V"], bias=False)
        s.register_buffer("cos", cos, persistent=False)
        s.register_buffer("sin", sin, persistent=False)
        for n, p in s.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(s, idx, tgt):
        x = s.emb(idx)
        for b in s.blocks:
            x = b(x, s.cos.to(x.dtype), s.sin.to(x.dtype))
        logits = s.out(s.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1))


def flops_per_token(c):
    """Megatron's count: 6 x the active matmul parameters, the causal attention, the output layer."""
    h, L, S, V = c["h"], c["L"], c["S"], c["V"]
    if c["arch"] == "deepseek":
        nh = c["nh"]
        attn = (h * c["q_lora"] + c["q_lora"] * nh * (c["nope"] + c["rope"]) + h * (c["kv_lora"] + c["rope"]) +
                c["kv_lora"] * nh * (c["nope"] + c["v"]) + nh * c["v"] * h)
        moe = h * c["E"] + (c["k"] + 1) * 3 * h * c["f"]
        dense = 3 * h * c["dense_f"]
        active = L * attn + dense + (L - 1) * moe
        core = L * 2 * nh * ((c["nope"] + c["rope"]) + c["v"]) * S / 2  # forward QK^T and PV over S/2 keys
        return 6 * active + 6 * V * h + 3 * core
    nh, kv, hd = c["nh"], c["kv"], c["hd"]
    attn = h * (nh + 2 * kv) * hd + nh * hd * h
    moe = h * c["E"] + c["k"] * 3 * h * c["f"]
    active = L * (attn + moe)
    keys = sum((min(c["window"], S) if i % 2 == 0 else S / 2) for i in range(L))  # mean visible keys per layer
    core = 2 * 2 * nh * hd * keys  # forward QK^T and PV over the visible keys
    return 6 * active + 6 * V * h + 3 * core


def run(c, compile_, steps=10):
    torch.manual_seed(0)
    m = Model(c).to(DEVICE)
    n_all = sum(p.numel() for p in m.parameters())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(m) if compile_ else m
    idx = torch.randint(0, c["V"], (c["mbs"], c["S"]), device=DEVICE)
    tgt = torch.randint(0, c["V"], (c["mbs"], c["S"]), device=DEVICE)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = fwd(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
    w = sorted(times[3:])
    dt = w[len(w) // 2]
    tok = c["mbs"] * c["S"] / dt
    fpt = flops_per_token(c)
    print(json.dumps(dict(system="pytorch-" + ("compile" if compile_ else "eager"), model=c["arch"],
                          params_M=round(n_all / 1e6, 1), step_ms=round(dt * 1e3, 2), tokens_per_s=round(tok),
                          tflops=round(tok * fpt / 1e12, 1), mfu=round(tok * fpt / PEAK, 4),
                          peak_mem_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else 0,
                          loss=round(loss.item(), 4))), flush=True)
    del m, opt, fwd
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the code (tiny shapes)")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    DEVICE = a.device
    cfg = dict(PRESETS[a.preset])
    if a.layers:
        cfg["L"] = a.layers
    if a.seq:
        cfg["S"] = a.seq
    for mode in a.modes.split(","):
        try:
            run(cfg, compile_=(mode == "compile"), steps=a.steps)
        except Exception as e:
            print(json.dumps(dict(system="pytorch-" + mode, model=cfg["arch"], error=repr(e)[:400])), flush=True)
