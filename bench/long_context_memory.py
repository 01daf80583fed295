"""The longest sequence a model trains at on one H200, and under context parallelism, from measured peaks.

bench/long_context_gpu.sh memory measures bench/gpt_throughput's peak memory (our allocator's peak,
every tensor of the step) with full recomputation (--recompute full: uniform, one layer per chunk)
at three sequence lengths per preset. With recomputation and flash-style attention every term of the
peak beyond the weights and Adam state grows linearly with the sequence a rank holds (the kept layer
inputs, one layer's recomputed activations, the logits and their gradient), so
    peak(s) = A + B s
fits the points (least squares; the printed residual says how well). One rank of CP = N holds s = S / N
of each sequence (Note [Load-balanced chunks]); the p2p ring adds the next block's keys/values and, in
backward, their gradients: 2 x 2 x (S/N) x groups x head_dim x 2 bytes per layer in flight, counted. So
    S_max(N) = N (M - A) / (B + ring)
for a usable memory M (default 139 GiB, what the H200 lends), rounded down to a multiple of 2N x 128.
CP 2/4/8 are computed from the CP 1 fit (their correctness is the CPU ranks' tests; more GPUs have not
been available).

  python3 bench/long_context_memory.py bench/results/h200_long_context.jsonl [--usable-gib 139]
"""
import argparse, json

SHAPES = {  # layers, query groups, head dim (the ring's key/value blocks)
    "llama-1B": (16, 8, 64),
    "llama-8B-layers": (8, 8, 128),
}


def fit(points):
    n = len(points)
    mx = sum(s for s, _ in points) / n
    my = sum(m for _, m in points) / n
    b = sum((s - mx) * (m - my) for s, m in points) / sum((s - mx) ** 2 for s, _ in points)
    a = my - b * mx
    resid = max(abs(a + b * s - m) for s, m in points)
    return a, b, resid


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl")
    ap.add_argument("--usable-gib", type=float, default=139.0)
    a = ap.parse_args()
    M = a.usable_gib * 2**30
    rows = [json.loads(l) for l in open(a.jsonl) if l.startswith("{")]
    for preset, (L, groups, hd) in SHAPES.items():
        pts = sorted({(r["seq"], r["peak_mem_gb"] * 1e9) for r in rows
                      if r.get("bench") == "gpt_throughput" and r["preset"] == preset and r.get("recompute") == "full"})
        if len(pts) < 2:
            continue
        A, B, resid = fit(pts)
        ring = 2 * 2 * groups * hd * 2  # bytes per position held: next keys/values + their gradients, one layer
        out = dict(bench="long_context_memory", preset=preset, usable_gib=a.usable_gib,
                   points=[dict(seq=s, peak_gb=round(m / 1e9, 2)) for s, m in pts],
                   fixed_gb=round(A / 1e9, 2), bytes_per_position=round(B), fit_residual_gb=round(resid / 1e9, 2))
        for n in (1, 2, 4, 8):
            per_pos = B + (ring if n > 1 else 0)
            s = int(n * (M - A) / per_pos)
            unit = 2 * n * 128
            out[f"max_seq_cp{n}"] = s // unit * unit
        print(json.dumps(out))
