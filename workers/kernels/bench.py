"""Correctness at real sizes and timing of each Triton kernel against its torch reference.

    python -m pocketllm.workers.kernels.bench [--out DIR] [--tune] [--flex]

CUDA only. Errors are ||out - truth|| / ||truth||, truth being the torch reference
run in float32 on upcast inputs; the kernel (bf16) and the torch reference in bf16
are both reported against it. Times are medians of CUDA-event timings
(``triton.testing.do_bench``, which flushes L2 between runs), taken two ways:
eager (each call launched from Python, as the runner does today; small cases are
bound by launch cost) and replaying a CUDA graph of one call (device time alone).
``host_us`` is the Python cost of one eager call. ``--tune`` first sweeps the
kernels' launch settings under CUDA graphs and applies the best before measuring.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from ..kernel_policy import KernelPolicy
from ..layers.activation import act_and_mul as torch_act_and_mul, get_activation
from ..layers.attention import ScheduledSeq, TorchAttention, build_metadata
from ..layers.rotary import RotaryTable, apply_rotary
from . import paged_decode_attention as decode_mod, prefill_attention as prefill_mod
from .attention_backend import TritonAttention, _sdpa_causal
from .gated_act import act_and_mul
from .kv_write import write_kv
from .rmsnorm import add_rms_norm
from .rotary import apply_rotary_qk

DEV = torch.device("cuda")
BF16 = torch.bfloat16
LLAMA = dict(name="llama3-8b", heads=32, kv_heads=8, dim=128, softcap=None)
GEMMA = dict(name="gemma3-270m", heads=4, kv_heads=1, dim=256, softcap=None)
ROWS: list[dict] = []
# (batch, max context) of the decode cases; contexts drawn in [max/2, max) per sequence
DECODE_SIZES = ((1, 4096), (8, 1024), (8, 4096), (32, 2048), (64, 1024), (64, 4096))
PREFILL_CASES = (("fresh 1x4096", [(0, 4096)]), ("fresh 4x1024", [(0, 1024)] * 4),
                 ("fresh 16x256", [(0, 256)] * 16), ("chunk 2048 on 2048", [(2048, 2048)]),
                 ("chunk 512 on 3584, x4", [(3584, 512)] * 4),
                 ("mixed 1x1024 + 63 decodes", [(0, 1024)] + [(2000, 1)] * 63))
LAYER_TOKENS, HIDDEN, INTER = (1, 64, 4096), 4096, 14336


def rel_err(out: torch.Tensor, truth: torch.Tensor) -> float:
    out, truth = out.double(), truth.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - truth).norm() / truth.norm())


def median_ms(fn) -> float:
    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def graph_ms(fn) -> float:
    """Device time of one call: replay a CUDA graph that captured it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = median_ms(graph.replay)
    del graph
    return ms


def host_us(fn, calls: int = 30) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * spent / calls


def compare(section: str, case: str, fn, ref_fn, err: float, ref_err: float, note: str = ""):
    row = dict(section=section, case=case, eager_ms=median_ms(fn), torch_eager_ms=median_ms(ref_fn),
               graph_ms=graph_ms(fn), torch_graph_ms=graph_ms(ref_fn), host_us=host_us(fn),
               torch_host_us=host_us(ref_fn), err=err, torch_err=ref_err, note=note)
    ROWS.append(row)
    return row


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


class PagedStep:
    """A step over a random paged cache: specs are (cached tokens, new tokens) per seq."""

    def __init__(self, specs, heads, kv_heads, dim, block_size=16, seed=0):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        need = [math.ceil((c + n) / block_size) for c, n in specs]
        self.num_blocks = sum(need) + 8
        order = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(seed))
        slots = (self.num_blocks + 1) * block_size
        self.k_cache = torch.randn(slots, kv_heads, dim, device=DEV, generator=gen).to(BF16)
        self.v_cache = torch.randn(slots, kv_heads, dim, device=DEV, generator=gen).to(BF16)
        self.pad = self.num_blocks * block_size
        self.k_cache[self.pad:] = 0
        self.v_cache[self.pad:] = 0
        self.seqs, row, at = [], 0, 0
        for (cached, n), blocks in zip(specs, need):
            self.seqs.append(ScheduledSeq(order[at:at + blocks].tolist(), cached, n, row))
            at, row = at + blocks, row + n
        self.q = torch.randn(row, heads, dim, device=DEV, generator=gen).to(BF16)
        self.k = torch.randn(row, kv_heads, dim, device=DEV, generator=gen).to(BF16)
        self.v = torch.randn(row, kv_heads, dim, device=DEV, generator=gen).to(BF16)
        self.block_size = block_size
        self.kv_bytes = sum(c + n for c, n in specs) * kv_heads * dim * 2 * 2
        self.flops = sum(4 * n * (c + n / 2) for c, n in specs) * heads * dim

    def meta(self, window, kernel_tables):
        return build_metadata(self.seqs, self.block_size, [window], DEV, self.pad,
                              kernel_tables=kernel_tables)


def attention_case(section: str, shape: dict, specs, window, label: str, seed=0):
    step = PagedStep(specs, shape["heads"], shape["kv_heads"], shape["dim"], seed=seed)
    scale, softcap = shape["dim"] ** -0.5, shape["softcap"]
    tri, ref = TritonAttention(), TorchAttention()
    t0 = time.perf_counter()
    meta_k = step.meta(window, True)
    t1 = time.perf_counter()
    meta_t = step.meta(window, False)
    t2 = time.perf_counter()
    args = (step.q, step.k, step.v, step.k_cache, step.v_cache)
    out = tri.forward(*args, meta_k, window, scale, softcap)
    out_ref = ref.forward(*args, meta_t, window, scale, softcap)
    truth = ref.forward(*[t.float() for t in args], meta_t, window, scale, softcap)
    note = f"host meta {1e3 * (t1 - t0):.2f} ms (torch groups {1e3 * (t2 - t1):.2f} ms)"
    row = compare(section, f"{shape['name']} {label}",
                  lambda: tri.forward(*args, meta_k, window, scale, softcap),
                  lambda: ref.forward(*args, meta_t, window, scale, softcap),
                  rel_err(out, truth), rel_err(out_ref, truth), note)
    row["note"] += (f"; {step.kv_bytes / row['graph_ms'] / 1e6:.0f} GB/s KV" if section == "decode"
                    else f"; {step.flops / row['graph_ms'] / 1e9:.0f} TFLOP/s")
    emit(row)


def decode_cases():
    for shape, window in ((LLAMA, None), (GEMMA, 512), (GEMMA, None)):
        for batch, ctx in DECODE_SIZES:
            gen = torch.Generator().manual_seed(batch)
            lens = torch.randint(ctx // 2, ctx, (batch,), generator=gen).tolist()
            w = f" w{window}" if window else ""
            attention_case("decode", shape, [(n, 1) for n in lens], window,
                           f"B{batch} ctx<={ctx}{w}")
    softcapped = dict(GEMMA, softcap=50.0, name="gemma3-270m softcap50")
    ctx = DECODE_SIZES[-1][1]
    attention_case("decode", softcapped, [(ctx - 1, 1)] * 16, 512, f"B16 ctx{ctx} w512")


def prefill_cases():
    for shape, window in ((LLAMA, None), (GEMMA, 512), (GEMMA, None)):
        for label, specs in PREFILL_CASES:
            if shape is GEMMA and window is None and not label.startswith("fresh 1x"):
                continue  # Gemma's global layers: only the lone long prompt differs
            attention_case("prefill", shape, specs, window,
                           label + (f" w{window}" if window else ""))


def layer_cases():
    for tokens in LAYER_TOKENS:
        x = torch.randn(tokens, HIDDEN, device=DEV).to(BF16)
        res = torch.randn(tokens, HIDDEN, device=DEV).to(BF16)
        w = torch.rand(HIDDEN, device=DEV) + 0.5

        def ref_norm():
            s = x + res
            return F.rms_norm(s.float(), (HIDDEN,), w, 1e-6).to(BF16), s
        out, new_res = add_rms_norm(x, res, w, 1e-6)
        truth = F.rms_norm((x.float() + res.float()), (HIDDEN,), w, 1e-6)
        emit(compare("layer", f"add+rmsnorm T{tokens} h{HIDDEN}",
                     lambda: add_rms_norm(x, res, w, 1e-6), ref_norm, rel_err(out, truth),
                     rel_err(ref_norm()[0], truth),
                     f"residual bit-exact: {bool(torch.equal(new_res, x + res))}"))
        table = RotaryTable(128, {"rope_theta": 500000.0}, 8192, DEV, BF16)
        cos, sin = table.lookup(torch.randint(0, 8000, (tokens,), device=DEV), 8191)
        qkv = torch.randn(tokens, 48 * 128, device=DEV).to(BF16)
        q, k = qkv[:, :4096].view(tokens, 32, 128), qkv[:, 4096:5120].view(tokens, 8, 128)
        ref_q = apply_rotary(q, cos, sin)
        truth = apply_rotary(q.float(), cos.float(), sin.float())
        keep = qkv.clone()
        err = rel_err(apply_rotary_qk(q, k, cos, sin)[0], truth)
        qkv.copy_(keep)
        emit(compare("layer", f"rotary q+k T{tokens} 32/8x128",
                     lambda: apply_rotary_qk(q, k, cos, sin),
                     lambda: (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)),
                     err, rel_err(ref_q, truth), "in place vs 2 new tensors"))
        gate_up = torch.randn(tokens, 2 * INTER, device=DEV).to(BF16)
        silu = get_activation("silu")
        truth = torch_act_and_mul(silu, gate_up.float())
        emit(compare("layer", f"silu*up T{tokens} I{INTER}", lambda: act_and_mul(gate_up),
                     lambda: torch_act_and_mul(silu, gate_up),
                     rel_err(act_and_mul(gate_up), truth),
                     rel_err(torch_act_and_mul(silu, gate_up), truth)))
        cache_k = torch.randn(70000, 8, 128, device=DEV).to(BF16)
        cache_v = torch.randn_like(cache_k)
        slots32 = torch.randperm(70000, device=DEV)[:tokens].to(torch.int32)
        slots64 = slots32.long()
        kk, vv = qkv[:, 4096:5120].view(tokens, 8, 128), qkv[:, 5120:].view(tokens, 8, 128)
        write_kv(kk, vv, cache_k, cache_v, slots32)
        ok = torch.equal(cache_k[slots64], kk) and torch.equal(cache_v[slots64], vv)
        emit(compare("layer", f"kv write T{tokens} 8x128",
                     lambda: write_kv(kk, vv, cache_k, cache_v, slots32),
                     lambda: (cache_k.index_copy_(0, slots64, kk),
                              cache_v.index_copy_(0, slots64, vv)),
                     0.0 if ok else float("nan"), 0.0))


def _best(name: str, candidates, cases, run) -> object:
    """The candidate with the lowest geometric mean of graph time over ``cases``."""
    scores = {}
    for cand in candidates:
        logs = []
        for case in cases:
            try:
                ms = graph_ms(lambda: run(cand, case))
            except Exception as e:  # e.g. out of shared memory
                print(f"tune {name} {cand}: {type(e).__name__}: {str(e)[:100]}")
                ms = float("inf")
            logs.append(math.log(ms))
            print(json.dumps(dict(tune=name, cand=str(cand), case=case[0], ms=round(ms, 4))))
        scores[cand] = sum(logs) / len(logs)
    best = min(scores, key=scores.get)
    print(json.dumps(dict(tune=name, best=str(best))), flush=True)
    return best


def _run_decode(tiles, case, policy: KernelPolicy = KernelPolicy(triton=True)):
    _label, (step, meta), window = case
    d = meta.decode
    span = min(d.max_seq_len, window) if window else d.max_seq_len
    block_n = (tiles or decode_mod.decode_tiles(step.q.shape[2], step.k_cache.element_size()))[0]
    partition = policy.decode_partition(d.block_tables.shape[0], step.k_cache.shape[1], span,
                                        decode_mod.sm_count(DEV), block_n)
    decode_mod.paged_decode_attention(step.q, step.k_cache, step.v_cache, d.block_tables,
                                      d.seq_lens, d.q_start, d.max_seq_len, 16, 0.1, window,
                                      None, tiles=tiles, partition=partition)


def _written(shape, specs, window):
    step = PagedStep(specs, shape["heads"], shape["kv_heads"], shape["dim"])
    meta = step.meta(window, True)
    write_kv(step.k, step.v, step.k_cache, step.v_cache, meta.slot_mapping)
    return step, meta


def tune():
    """Sweep launch settings under CUDA graphs; print the best (the kernel modules' TILES
    and the KernelPolicy's attention thresholds take them by hand)."""
    all_steps = []
    for dim_class, shape, cases in (
            (128, LLAMA, [(1, 4096, None), (8, 4096, None), (64, 1024, None), (64, 4096, None)]),
            (256, GEMMA, [(1, 4096, 512), (64, 4096, 512), (8, 4096, None), (64, 4096, None)])):
        steps = [(f"{shape['name']} B{b} ctx{c} w{w}", _written(shape, [(c - 1, 1)] * b, w), w)
                 for b, c, w in cases]
        all_steps += steps
        decode_mod.TILES[dim_class] = _best(f"decode tiles d{dim_class}",
                                            ((32, 4), (64, 4), (128, 4), (64, 8)), steps,
                                            _run_decode)

    def run_split(cand, case):
        _run_decode(None, case, KernelPolicy(triton=True, decode_min_partition=cand[0],
                                             decode_programs_per_sm=cand[1]))
    min_partition, programs_per_sm = _best(
        "decode split", [(p, s) for p in (64, 128, 256, 512) for s in (1, 2, 4, 8)], all_steps,
        run_split)
    sdpa_min_rows = {}
    for dim_class, shape, window, cases in (
            (128, LLAMA, None, [[(0, 4096)], [(3584, 512)] * 4, [(0, 256)] * 16, [(0, 1024)] * 4]),
            (256, GEMMA, 512, [[(0, 4096)], [(3584, 512)] * 4, [(0, 256)] * 16])):
        steps = [(str(specs[0]) + f"x{len(specs)}", _written(shape, specs, window))
                 for specs in cases]

        def run_prefill(cand, case):
            _label, (step, meta) = case
            p = meta.prefill
            prefill_mod.prefill_attention(step.q, step.k_cache, step.v_cache, p.block_tables,
                                          p.seq_lens, p.q_start, p.q_lens, p.max_q_len, 16, 0.1,
                                          window, None, tiles=cand)
        prefill_mod.TILES[dim_class] = _best(
            f"prefill tiles d{dim_class}",
            ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 8, 3),
             (64, 32, 4, 2)), steps, run_prefill)
        # Lone fresh prompt: from which length SDPA's flash kernel beats ours.
        threshold = 1 << 30
        for length in (8192, 4096, 2048, 1024, 512):
            step, meta = _written(shape, [(0, length)], None)
            p = meta.prefill
            ours = graph_ms(lambda: prefill_mod.prefill_attention(
                step.q, step.k_cache, step.v_cache, p.block_tables, p.seq_lens, p.q_start,
                p.q_lens, p.max_q_len, 16, 0.1))
            sdpa = graph_ms(lambda: _sdpa_causal(step.q, step.k, step.v, 0.1))
            print(json.dumps(dict(tune=f"sdpa d{dim_class}", length=length, triton_ms=ours,
                                  sdpa_ms=sdpa)))
            if sdpa >= ours:
                break
            threshold = length
        sdpa_min_rows[dim_class] = threshold
    print(json.dumps(dict(tuned=dict(decode_tiles=decode_mod.TILES,
                                     decode_min_partition=min_partition,
                                     decode_programs_per_sm=programs_per_sm,
                                     prefill_tiles=prefill_mod.TILES,
                                     sdpa_min_rows=sdpa_min_rows))),
          flush=True)


def flex_cases():
    """FlexAttention on the same packed varlen prefill (K/V gathered from the paged cache,
    as the torch path does); its per-step block-mask build is timed apart."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    for label, specs in (("fresh 4x1024", [(0, 1024)] * 4),
                         ("chunk 512 on 3584, x4", [(3584, 512)] * 4)):
        step, meta = _written(LLAMA, specs, None)
        kv_slots, q_doc, q_pos, k_doc, k_pos = [], [], [], [], []
        for i, s in enumerate(step.seqs):
            total = s.start + s.num_tokens
            pos = torch.arange(total)
            kv_slots.append(torch.tensor(s.block_ids)[pos // 16] * 16 + pos % 16)
            k_doc.append(torch.full((total,), i))
            k_pos.append(pos)
            q_doc.append(torch.full((s.num_tokens,), i))
            q_pos.append(torch.arange(s.start, total))
        kv_slots, q_doc, q_pos, k_doc, k_pos = (torch.cat(t).to(DEV) for t in
                                                (kv_slots, q_doc, q_pos, k_doc, k_pos))

        def mask_mod(b, h, qi, ki):
            return (q_doc[qi] == k_doc[ki]) & (k_pos[ki] <= q_pos[qi])
        t0 = time.perf_counter()
        block_mask = create_block_mask(mask_mod, None, None, len(q_doc), len(k_doc), device=DEV)
        torch.cuda.synchronize()
        mask_ms = 1e3 * (time.perf_counter() - t0)

        def run_flex():
            kg = step.k_cache.index_select(0, kv_slots).transpose(0, 1).unsqueeze(0)
            vg = step.v_cache.index_select(0, kv_slots).transpose(0, 1).unsqueeze(0)
            return flex(step.q.transpose(0, 1).unsqueeze(0), kg, vg, block_mask=block_mask,
                        scale=0.1, enable_gqa=True)
        p = meta.prefill

        def run_ours():
            return prefill_mod.prefill_attention(step.q, step.k_cache, step.v_cache,
                                                 p.block_tables, p.seq_lens, p.q_start,
                                                 p.q_lens, p.max_q_len, 16, 0.1)
        err = rel_err(run_flex()[0].transpose(0, 1), run_ours().float())
        print(json.dumps(dict(flex=f"llama3-8b {label}", triton_ms=median_ms(run_ours),
                              flex_ms=median_ms(run_flex), flex_vs_triton_err=err,
                              block_mask_ms=mask_ms)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--flex", action="store_true")
    parser.add_argument("--only", default="decode,prefill,layer")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    with torch.inference_mode():
        if args.tune:
            tune()
        parts = {"decode": decode_cases, "prefill": prefill_cases, "layer": layer_cases}
        for name in args.only.split(","):
            if name:
                parts[name]()
        if args.flex:
            try:
                flex_cases()
            except Exception as e:  # optional: must not lose the table
                print(f"flex failed: {type(e).__name__}: {str(e)[:300]}")
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    print(f"\n{'case':<50} {'eager':>7} {'torch':>7} {'graph':>7} {'torch':>7} {'host_us':>7} "
          f"{'torch':>6} {'err':>7} {'torch':>7}")
    for r in ROWS:
        print(f"{r['section'][:7] + ' ' + r['case']:<50} {r['eager_ms']:>7.4f} "
              f"{r['torch_eager_ms']:>7.4f} {r['graph_ms']:>7.4f} {r['torch_graph_ms']:>7.4f} "
              f"{r['host_us']:>7.0f} {r['torch_host_us']:>6.0f} {r['err']:>7.1e} "
              f"{r['torch_err']:>7.1e}")


if __name__ == "__main__":
    main()
