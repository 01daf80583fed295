"""Reference throughput: the same GPT (or Llama-style model) trained by plain PyTorch on the same GPU.

A copy of ../shared/bench/pytorch_gpt_reference.py with Llama-style presets and the GPT-2 1.5B shape of
BENCHMARKS.md added; the GPT presets behave as
there (same model, optimizer, timing and FLOPs), so their figures stay comparable with it.
Run it in the same command on the GPU machine as our own benchmark, so the two figures share one machine
(bench/run_gpu.sh bench runs both and prints the ratios).

GPT: pre-LN GPT-2 style (learned positions, LayerNorm, tanh-GeLU MLP of 4h, tied embeddings).
Llama: pre-RMSNorm (eps 1e-5), RoPE (fp32 angles, rotate-half), grouped-query attention, SwiGLU MLP,
no biases, untied output layer, vocabulary padded to a multiple of 128 as Megatron pads it.
Both: bf16 autocast over fp32 weights, SDPA flash attention, fused AdamW, with and without torch.compile.

  python3 pytorch_reference.py --layers 24 --hidden 2048 --heads 16 --seq 2048 --mbs 8
  python3 pytorch_reference.py --preset gpt2-124M
  python3 pytorch_reference.py --preset llama-1B            # bench/gpt_throughput --preset llama-1B
  python3 pytorch_reference.py --preset llama-1B --seq 32768 --mbs 1 --doc-mean 2048   # packed documents

--doc-mean N packs documents into each sequence, with bench/gpt_throughput's lengths (document i of the
run: N/2 + (((i + 1) * 2654435761) mod 2^32) mod N, row r starting at i = 1000 r, the last one cut), and
attends within each document through FlexAttention with a document-causal BlockMask (torch.compile'd
flex_attention in both modes: eager FlexAttention is a reference implementation, not a kernel).

Prints one JSON line per mode. FLOPs per token (Megatron's num_floating_point_operations, causal attention
counted as half, as megatron/training/training_log.cpp does):
  GPT:   6 * N_nonembedding + 6 * V * h + 6 * L * h * s   (forward + backward)
  Llama: 6 * L * (h * (q + k + v) + q * s + q * h + 3 * h * ffn) + 6 * V * h,  q = h, k = v = h * groups / heads
MFU is against 989 TFLOP/s, the H100/H200 dense bf16 peak.
"""
import argparse, json, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

PEAK = 989e12
PRESETS = {  # layers, hidden, heads, seq, micro-batch
    "gpt2-124M": (12, 768, 12, 1024, 32),
    "gpt2-350M": (24, 1024, 16, 1024, 16),
    "gpt-1.3B": (24, 2048, 16, 2048, 8),
    "gpt2-1.5B": (48, 1600, 25, 1024, 8),
    "gpt-2.7B": (32, 2560, 32, 2048, 8),
}
LLAMA_PRESETS = {  # layers, hidden, heads, query groups, ffn, seq, micro-batch, vocab, RoPE base
    "llama-1B": (16, 2048, 32, 8, 8192, 4096, 2, 128256, 500000.0),  # Llama-3.2-1B-like, untied output
    # eight layers of Llama-3-8B's shape with its vocabulary, as bench/gpt_throughput's preset
    "llama-8B-layers": (8, 4096, 32, 8, 14336, 8192, 1, 128256, 500000.0),
}


class Block(nn.Module):
    def __init__(s, h, nh):
        super().__init__()
        s.ln1, s.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        s.qkv, s.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        s.fc1, s.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        s.nh = nh

    def forward(s, x):
        B, T, C = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, s.nh, C // s.nh).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + s.fc2(F.gelu(s.fc1(s.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(s, L, h, nh, V, S):
        super().__init__()
        s.wte, s.wpe = nn.Embedding(V, h), nn.Embedding(S, h)
        s.blocks = nn.ModuleList(Block(h, nh) for _ in range(L))
        s.lnf = nn.LayerNorm(h)
        for p in s.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(s, idx, tgt):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in s.blocks:
            x = b(x)
        logits = F.linear(s.lnf(x), s.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1))


def rotate(x, cos, sin):
    """RoPE, rotate-half layout (Megatron's default, HF Llama), computed in fp32, returned in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).type_as(x)


class LlamaBlock(nn.Module):
    # Fused QKV and fused gate/up projections, as Megatron's linear_qkv and linear_fc1 (GLU) are.
    def __init__(s, h, nh, ng, ffn, eps, native_gqa):
        super().__init__()
        s.nh, s.ng, s.hd, s.native_gqa = nh, ng, h // nh, native_gqa
        s.ln1, s.ln2 = nn.RMSNorm(h, eps=eps), nn.RMSNorm(h, eps=eps)
        s.qkv = nn.Linear(h, (nh + 2 * ng) * s.hd, bias=False)
        s.proj = nn.Linear(nh * s.hd, h, bias=False)
        s.fc1, s.fc2 = nn.Linear(h, 2 * ffn, bias=False), nn.Linear(ffn, h, bias=False)

    def forward(s, x, cos, sin, block_mask=None):
        B, T, C = x.shape
        q, k, v = s.qkv(s.ln1(x)).split([s.nh * s.hd, s.ng * s.hd, s.ng * s.hd], dim=2)
        q = rotate(q.view(B, T, s.nh, s.hd).transpose(1, 2), cos, sin)
        k = rotate(k.view(B, T, s.ng, s.hd).transpose(1, 2), cos, sin)
        v = v.view(B, T, s.ng, s.hd).transpose(1, 2)
        if block_mask is not None:
            y = FLEX(q, k, v, block_mask=block_mask, enable_gqa=True)
        elif s.native_gqa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k, v = (t.repeat_interleave(s.nh // s.ng, dim=1) for t in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.proj(y.transpose(1, 2).reshape(B, T, s.nh * s.hd))
        gate, up = s.fc1(s.ln2(x)).chunk(2, dim=-1)
        return x + s.fc2(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(s, L, h, nh, ng, ffn, V, S, base, eps, native_gqa):
        super().__init__()
        s.wte = nn.Embedding(V, h)
        s.blocks = nn.ModuleList(LlamaBlock(h, nh, ng, ffn, eps, native_gqa) for _ in range(L))
        s.lnf = nn.RMSNorm(h, eps=eps)
        s.out = nn.Linear(h, V, bias=False)
        for p in s.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        hd = h // nh
        inv_freq = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        angles = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [S, hd], fp32
        s.register_buffer("cos", angles.cos(), persistent=False)
        s.register_buffer("sin", angles.sin(), persistent=False)

    def forward(s, idx, tgt, block_mask=None):
        x = s.wte(idx)
        T = idx.shape[1]
        cos, sin = s.cos[:T], s.sin[:T]
        for b in s.blocks:
            x = b(x, cos, sin, block_mask)
        logits = s.out(s.lnf(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1))


def flash_takes_gqa(hd):
    """Whether SDPA's flash kernel takes grouped K/V (enable_gqa) in bf16 here; otherwise SDPA would silently
    fall back to the unfused math kernel and K/V are better expanded first."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        q = torch.randn(1, 4, 256, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, 2, 256, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        return True
    except (RuntimeError, TypeError) as e:
        print(f"flash attention does not take enable_gqa here ({e}); expanding K/V instead", file=sys.stderr)
        return False


FLEX = None  # torch.compile(flex_attention), made once when --doc-mean is given


def document_ids(mbs, S, mean):
    """[mbs, S] document index of every position: bench/gpt_throughput's --doc-mean lengths."""
    rows = []
    for r in range(mbs):
        ids, pos, i, d = [], 0, r * 1000, 0
        while pos < S:
            n = max(mean // 2 + (((i + 1) * 2654435761) % 2**32) % mean, 1)
            n = min(n, S - pos)
            ids += [d] * n
            pos += n; i += 1; d += 1
        rows.append(ids)
    return torch.tensor(rows, device="cuda", dtype=torch.int32)


def run(shape, V, steps, compile_, preset=None, doc_mean=0):
    torch.manual_seed(0)
    if shape["arch"] == "gpt":
        L, h, nh, S, mbs = shape["L"], shape["h"], shape["nh"], shape["S"], shape["mbs"]
        m = GPT(L, h, nh, V, S).cuda()
        n_all = sum(p.numel() for p in m.parameters())
        n_nonemb = n_all - V * h - S * h
        fpt = 6 * n_nonemb + 6 * V * h + 6 * L * h * S
        extra = {}
    else:
        L, h, nh, ng, ffn, S, mbs = (shape[k] for k in ("L", "h", "nh", "ng", "ffn", "S", "mbs"))
        m = Llama(L, h, nh, ng, ffn, V, S, shape["base"], 1e-5, shape["native_gqa"]).cuda()
        n_all = sum(p.numel() for p in m.parameters())
        q = h; kv = h * ng // nh  # kv_channels * heads, kv_channels * groups
        fpt = 6 * L * (h * (q + 2 * kv) + q * S + q * h + 3 * h * ffn) + 6 * V * h
        extra = dict(query_groups=ng, ffn=ffn, gqa="enable_gqa" if shape["native_gqa"] else "repeat_interleave")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(m) if compile_ else m
    idx = torch.randint(0, V, (mbs, S), device="cuda")
    tgt = torch.randint(0, V, (mbs, S), device="cuda")
    block_mask = None
    if doc_mean:
        from torch.nn.attention.flex_attention import create_block_mask
        doc = document_ids(mbs, S, doc_mean)
        extra.update(doc_mean=doc_mean, documents=int(sum(int(r.max()) + 1 for r in doc)))

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)
        block_mask = create_block_mask(document_causal, mbs, None, S, S, device="cuda")
    times = []
    for _ in range(steps):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(idx, tgt, block_mask) if doc_mean else fwd(idx, tgt)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
    warm = sorted(times[3:])
    dt = warm[len(warm) // 2]
    tok = mbs * S / dt
    print(json.dumps(dict(
        system="pytorch-" + ("compile" if compile_ else "eager"), preset=preset, layers=L, hidden=h, heads=nh,
        seq=S, mbs=mbs, vocab=V, **extra, params_M=round(n_all / 1e6, 1), step_ms=round(dt * 1e3, 2),
        tokens_per_s=round(tok), tflops=round(tok * fpt / 1e12, 1), mfu=round(tok * fpt / PEAK, 4),
        peak_mem_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2), loss=round(loss.item(), 4))), flush=True)
    del m, opt, fwd
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS) + sorted(LLAMA_PRESETS))
    ap.add_argument("--layers", type=int); ap.add_argument("--hidden", type=int); ap.add_argument("--heads", type=int)
    ap.add_argument("--seq", type=int); ap.add_argument("--mbs", type=int)
    ap.add_argument("--vocab", type=int, help="default 50304 (GPT), the preset's (Llama)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--doc-mean", type=int, default=0, help="Llama: pack documents of about this mean length")
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--gqa", choices=["auto", "native", "repeat"], default="auto",
                    help="Llama attention: SDPA enable_gqa (native), K/V repeat_interleave, or native where flash takes it")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    if a.preset in LLAMA_PRESETS:
        L, h, nh, ng, ffn, S, mbs, V, base = LLAMA_PRESETS[a.preset]
        L, S, mbs = a.layers or L, a.seq or S, a.mbs or mbs
        V = a.vocab or V
        V = (V + 127) // 128 * 128  # Megatron's padding (make_vocab_size_divisible_by 128, TP 1)
        native = flash_takes_gqa(h // nh) if a.gqa == "auto" else a.gqa == "native"
        shape = dict(arch="llama", L=L, h=h, nh=nh, ng=ng, ffn=ffn, S=S, mbs=mbs, base=base, native_gqa=native)
    else:
        L, h, nh, S, mbs = PRESETS[a.preset] if a.preset else (a.layers, a.hidden, a.heads, a.seq, a.mbs)
        V = a.vocab or 50304
        shape = dict(arch="gpt", L=L, h=h, nh=nh, S=S, mbs=mbs)
    if a.doc_mean:
        assert shape["arch"] == "llama", "--doc-mean: Llama presets"
        from torch.nn.attention.flex_attention import flex_attention
        FLEX = torch.compile(flex_attention)
    for mode in a.modes.split(","):
        run(shape, V, a.steps, mode == "compile", a.preset, a.doc_mean)
