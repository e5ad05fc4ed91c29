"""Gated DeltaNet's operations (workers/layers/gated_delta.py, issue 35) against
transformers' own torch forms of them, and against each other: the chunked prefill form
equals the token-by-token decode form, a prompt split at any token equals one call, and a
whole Qwen3.5 linear-attention layer composed from them equals transformers'
``Qwen3_5GatedDeltaNet`` on a tiny random config, prefill and decode."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")
q35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

from pocketllm.workers.layers import gated_delta as gd  # noqa: E402

K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 16, 8


def _inputs(T: int, seed: int = 0, dims=(K_HEADS, V_HEADS, K_DIM, V_DIM)):
    k_heads, v_heads, k_dim, v_dim = dims
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(T, k_heads, k_dim), r(T, k_heads, k_dim), r(T, v_heads, v_dim)
    g = -torch.rand(T, v_heads, generator=gen) * 2  # decays exp(g) in (0.13, 1]
    beta = torch.rand(T, v_heads, generator=gen)
    state = r(v_heads, k_dim, v_dim) * 0.1
    return q, k, v, g, beta, state


def _reference(fn, q, k, v, g, beta, state, **kw):
    # q/k repeated to the value heads here: older transformers' forms do not group them;
    # unwrapped: older transformers call flash-linear-attention, where installed, whatever
    # the tensors' device
    fn = inspect.unwrap(fn)
    group = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    out, s = fn(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None],
                output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    return out[0], s[0]


@pytest.mark.parametrize("T", [1, 7, 64, 150])
def test_both_forms_equal_the_reference(T):
    args = _inputs(T, seed=T)
    want_out, want_state = _reference(q35.torch_recurrent_gated_delta_rule, *args)
    chunk_out, chunk_state = _reference(q35.torch_chunk_gated_delta_rule, *args)
    for out, state in (gd.recurrent(*args), gd.chunked(*args), gd.chunked(*args, chunk=16)):
        torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(state, want_state, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(chunk_out, want_out, atol=2e-5, rtol=1e-4)  # theirs agree too


@pytest.mark.parametrize("cut", [1, 30, 64, 100])
def test_a_prompt_split_anywhere_equals_one_call(cut):
    q, k, v, g, beta, state = _inputs(130, seed=3)
    whole_out, whole_state = gd.chunked(q, k, v, g, beta, state)
    first, s = gd.chunked(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], state)
    second, s = gd.chunked(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], s)
    torch.testing.assert_close(torch.cat([first, second]), whole_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, whole_state, atol=2e-5, rtol=1e-4)


def test_causal_conv_carries_its_state():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(20, 6, generator=gen), torch.randn(6, 4, generator=gen)
    whole, state = gd.causal_conv(x, w, torch.zeros(6, 3))
    want = q35.causal_conv1d_fn(x.t()[None], w, activation="silu")[0].t()
    torch.testing.assert_close(whole, want)
    a, s = gd.causal_conv(x[:13], w, torch.zeros(6, 3))
    b, s = gd.causal_conv(x[13:14], w, s)  # one decode token
    c, s = gd.causal_conv(x[14:], w, s)
    torch.testing.assert_close(torch.cat([a, b, c]), whole)
    torch.testing.assert_close(s, state)
    torch.testing.assert_close(state, x[-3:].t())


def _layer():
    cfg = q35.Qwen3_5TextConfig(
        hidden_size=32, linear_num_key_heads=K_HEADS, linear_num_value_heads=V_HEADS,
        linear_key_head_dim=K_DIM, linear_value_head_dim=V_DIM, linear_conv_kernel_dim=4,
        num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(0)
    layer = q35.Qwen3_5GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)  # not all ones
    return layer


def _ours(layer, h, conv_state, state):
    """The layer from gated_delta's operations and the layer's weights (one sequence)."""
    kd, vd = K_HEADS * K_DIM, V_HEADS * V_DIM
    mixed, conv_state = gd.causal_conv(h @ layer.in_proj_qkv.weight.t(),
                                       layer.conv1d.weight[:, 0], conv_state)
    q, k, v = mixed.split([kd, kd, vd], dim=-1)
    g, beta = gd.decay_and_beta(h @ layer.in_proj_a.weight.t(), h @ layer.in_proj_b.weight.t(),
                                layer.A_log, layer.dt_bias)
    form = gd.chunked if len(h) > 1 else gd.recurrent
    out, state = form(q.reshape(-1, K_HEADS, K_DIM), k.reshape(-1, K_HEADS, K_DIM),
                      v.reshape(-1, V_HEADS, V_DIM), g, beta, state)
    z = (h @ layer.in_proj_z.weight.t()).reshape(-1, V_HEADS, V_DIM)
    normed = gd.gated_rms_norm(out, z, layer.norm.weight, layer.layer_norm_epsilon)
    return normed.reshape(len(h), vd) @ layer.out_proj.weight.t(), conv_state, state


def test_a_qwen3_5_linear_attention_layer_prefill_then_decode(monkeypatch):
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        if hasattr(q35, name):  # the torch forms, as _reference calls them: not fla's
            monkeypatch.setattr(q35, name, inspect.unwrap(getattr(q35, name)))
    layer = _layer()
    h = torch.randn(90, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = layer(h[None])[0]
        conv, state = torch.zeros(2 * K_HEADS * K_DIM + V_HEADS * V_DIM, 3), torch.zeros(
            V_HEADS, K_DIM, V_DIM)
        out, conv, state = _ours(layer, h[:70], conv, state)  # a prompt across a chunk edge
        rows = [out]
        for t in range(70, 90):  # then decode, a token a step
            out, conv, state = _ours(layer, h[t:t + 1], conv, state)
            rows.append(out)
    torch.testing.assert_close(torch.cat(rows), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dims", [(2, 4, 16, 8), (1, 2, 128, 128)])
def test_the_c_decode_step_equals_the_recurrent_form(dims):
    """ops.c's step (the CPU worker's decode) on three sequences whose states lie
    at scattered slots of one pool, six tokens each, against ``recurrent``."""
    import numpy as np
    from pocketllm.workers.kernels import cpu_lib

    if not cpu_lib.available():
        pytest.skip(f"CPU kernels: {cpu_lib.unavailable_reason()}")
    hk, hv, dk, dv = dims
    gen = torch.Generator().manual_seed(5)
    M, T, slots = 3, 6, np.array([4, 0, 2], dtype=np.int64)
    pool = (torch.randn(5, hv, dk, dv, generator=gen) * 0.1).numpy()
    before = pool.copy()
    want_states = [torch.from_numpy(pool[s].copy()) for s in slots]
    lib = cpu_lib.lib()
    for _ in range(T):
        q, k = torch.randn(M, hk, dk, generator=gen), torch.randn(M, hk, dk, generator=gen)
        v = torch.randn(M, hv, dv, generator=gen)
        g, beta = -torch.rand(M, hv, generator=gen), torch.rand(M, hv, generator=gen)
        qn, kn, vn, gn, bn = (np.ascontiguousarray(x.numpy()) for x in (q, k, v, g, beta))
        out = np.empty((M, hv, dv), np.float32)
        assert lib.pq_gated_delta_step(qn.ctypes.data, kn.ctypes.data, hk * dk, vn.ctypes.data,
                                       hv * dv, gn.ctypes.data, bn.ctypes.data, hv, M, hk, hv,
                                       dk, dv, 0, pool.ctypes.data, slots.ctypes.data,
                                       out.ctypes.data, 0) == 0
        for m in range(M):
            want, want_states[m] = gd.recurrent(q[m:m + 1], k[m:m + 1], v[m:m + 1],
                                                g[m:m + 1], beta[m:m + 1], want_states[m])
            np.testing.assert_allclose(out[m], want[0].numpy(), rtol=1e-4, atol=1e-5)
    for m in range(M):
        np.testing.assert_allclose(pool[slots[m]], want_states[m].numpy(), rtol=1e-4, atol=1e-5)
    untouched = np.setdiff1d(np.arange(5), slots)
    assert np.array_equal(pool[untouched], before[untouched])  # other sequences' states


@pytest.mark.parametrize("dims", [(2, 4, 16, 8), (1, 2, 128, 128)])
@pytest.mark.parametrize("T", [1, 5, 64, 150])
def test_the_c_prefill_equals_the_chunked_form(dims, T):
    """ops.c's prompt form (the CPU worker's prefill), in two calls split mid-chunk, against
    ``chunked`` in one; then a C step from the state it left, against ``recurrent``."""
    import numpy as np
    from pocketllm.workers.kernels import cpu_lib

    if not cpu_lib.available():
        pytest.skip(f"CPU kernels: {cpu_lib.unavailable_reason()}")
    hk, hv, dk, dv = dims
    gen = torch.Generator().manual_seed(T)
    q, k = torch.randn(T + 1, hk, dk, generator=gen), torch.randn(T + 1, hk, dk, generator=gen)
    v = torch.randn(T + 1, hv, dv, generator=gen)
    g, beta = -torch.rand(T + 1, hv, generator=gen) * 2, torch.rand(T + 1, hv, generator=gen)
    state0 = torch.randn(hv, dk, dv, generator=gen) * 0.1
    want, want_state = gd.chunked(q[:T], k[:T], v[:T], g[:T], beta[:T], state0)
    qn, kn, vn, gn, bn = (np.ascontiguousarray(x.numpy()) for x in (q, k, v, g, beta))
    state = np.ascontiguousarray(state0.numpy().copy())
    out = np.empty((T, hv, dv), np.float32)
    lib = cpu_lib.lib()
    cut = T // 3
    for a, b in ((0, cut), (cut, T)):
        assert lib.pq_gated_delta_prefill(
            qn[a:].ctypes.data, kn[a:].ctypes.data, hk * dk, vn[a:].ctypes.data, hv * dv,
            gn[a:].ctypes.data, bn[a:].ctypes.data, hv, b - a, hk, hv, dk, dv, 0, state.ctypes.data,
            out[a:].ctypes.data, 0) == 0
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(state, want_state.numpy(), rtol=1e-4, atol=2e-5)
    step_out, slot = np.empty((1, hv, dv), np.float32), np.zeros(1, np.int64)
    assert lib.pq_gated_delta_step(qn[T:].ctypes.data, kn[T:].ctypes.data, hk * dk,
                                   vn[T:].ctypes.data, hv * dv, gn[T:].ctypes.data,
                                   bn[T:].ctypes.data, hv, 1, hk, hv, dk, dv, 0, state.ctypes.data,
                                   slot.ctypes.data, step_out.ctypes.data, 0) == 0
    want_step, _ = gd.recurrent(q[T:], k[T:], v[T:], g[T:], beta[T:], want_state)
    np.testing.assert_allclose(step_out, want_step.numpy(), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("form", ["step", "prefill"])
def test_the_c_forms_read_tiled_value_heads(form):
    """``tiled``: value head j * Hk + g reads q/k head g (llama.cpp's qwen35 order). The
    same heads in HF's grouped order give the same outputs and states, permuted."""
    import numpy as np
    from pocketllm.workers.kernels import cpu_lib
    from pocketllm.workers.loader.gguf_hybrid import grouped_order

    if not cpu_lib.available():
        pytest.skip(f"CPU kernels: {cpu_lib.unavailable_reason()}")
    hk, hv, dk, dv, T = 2, 6, 16, 8, 5
    gen = torch.Generator().manual_seed(11)
    q, k = torch.randn(T, hk, dk, generator=gen).numpy(), torch.randn(T, hk, dk, generator=gen).numpy()
    v = torch.randn(T, hv, dv, generator=gen).numpy()
    g, beta = -torch.rand(T, hv, generator=gen).numpy(), torch.rand(T, hv, generator=gen).numpy()
    state = (torch.randn(1, hv, dk, dv, generator=gen) * 0.1).numpy()
    order = grouped_order({"linear_num_key_heads": hk, "linear_num_value_heads": hv}, 1)
    lib = cpu_lib.lib()

    def run(v, g, beta, state, tiled):
        v, g, beta = (np.ascontiguousarray(x) for x in (v, g, beta))
        state = state.copy()  # written in place
        out = np.empty((T, hv, dv), np.float32)
        ptrs = (q.ctypes.data, k.ctypes.data, hk * dk, v.ctypes.data, hv * dv, g.ctypes.data,
                beta.ctypes.data, hv)
        if form == "prefill":
            assert lib.pq_gated_delta_prefill(*ptrs, T, hk, hv, dk, dv, tiled, state.ctypes.data,
                                              out.ctypes.data, 0) == 0
        else:
            slot = np.zeros(1, np.int64)
            for t in range(T):
                assert lib.pq_gated_delta_step(
                    q[t:].ctypes.data, k[t:].ctypes.data, hk * dk, v[t:].ctypes.data, hv * dv,
                    g[t:].ctypes.data, beta[t:].ctypes.data, hv, 1, hk, hv, dk, dv, tiled,
                    state.ctypes.data, slot.ctypes.data, out[t:].ctypes.data, 0) == 0
        return out, state

    grouped_out, grouped_state = run(v, g, beta, state, 0)
    inverse = np.argsort(order)  # grouped -> tiled
    tiled_out, tiled_state = run(v[:, inverse], g[:, inverse], beta[:, inverse],
                                 state[:, inverse], 1)
    np.testing.assert_allclose(tiled_out[:, order], grouped_out, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(tiled_state[:, order], grouped_state, rtol=1e-6, atol=1e-7)


def test_the_c_forms_refuse_bad_shapes():
    from pocketllm.workers.kernels import cpu_lib

    if not cpu_lib.available():
        pytest.skip(f"CPU kernels: {cpu_lib.unavailable_reason()}")
    lib = cpu_lib.lib()
    ok = dict(sqk=32, sv=32, sgb=4, M=1, Hk=2, Hv=4, Dk=16, Dv=8)
    for bad in (dict(Hv=3), dict(Dk=1024, sqk=2048), dict(sqk=8), dict(M=-1), dict(Hk=0)):
        a = {**ok, **bad}
        shape = (a["sqk"], None, a["sv"], None, None, a["sgb"], a["M"], a["Hk"], a["Hv"],
                 a["Dk"], a["Dv"])
        # the shapes are checked before any pointer is read
        assert lib.pq_gated_delta_step(None, None, *shape, 0, None, None, None, 0) == cpu_lib.ERR_ARG
        assert lib.pq_gated_delta_prefill(None, None, *shape, 0, None, None, 0) == cpu_lib.ERR_ARG


def test_the_batched_decode_step_equals_the_recurrent_form():
    """Three sequences' tokens in one ``decode_step``: each as ``recurrent`` alone."""
    seqs = [_inputs(1, seed=40 + i) for i in range(3)]
    out, states = gd.decode_step(*(torch.cat([s[i] for s in seqs]) for i in range(5)),
                                 torch.stack([s[5] for s in seqs]))
    for i, args in enumerate(seqs):
        want_out, want_state = gd.recurrent(*args)
        torch.testing.assert_close(out[i], want_out[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(states[i], want_state, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton forms need a GPU")
@pytest.mark.parametrize("dims", [(K_HEADS, V_HEADS, K_DIM, V_DIM), (16, 32, 128, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_forms_equal_the_torch_forms(dims, dtype):
    """flash-linear-attention's kernels (``kernels/gated_delta.py``) against the torch forms
    in float32: chunks of 60 and 90 tokens of two sequences from their states in one call
    (value heads grouped over the q/k heads, Qwen3.5-9B's 128 x 128 heads), and a decode
    step of three sequences."""
    pytest.importorskip("fla")
    from pocketllm.workers.kernels import gated_delta as fla_forms

    q, k, v, g, beta, state = _inputs(150, seed=9, dims=dims)
    batch = [_inputs(1, seed=50 + i, dims=dims) for i in range(3)]
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float32 else dict(atol=6e-2, rtol=5e-2)
    cuda = lambda x: x.cuda().to(dtype)  # noqa: E731
    states, starts = torch.stack([state, state * 0.5]), [0, 60, 150]  # two sequences
    want_out, want_state = gd.chunked_varlen(q, k, v, g, beta, states,
                                             gd.Segments(starts, torch.device("cpu")))
    out, s = fla_forms.chunked_varlen(cuda(q), cuda(k), cuda(v), g.cuda(), beta.cuda(),
                                      states.cuda(), gd.Segments(starts, torch.device("cuda")))
    torch.testing.assert_close(out.float().cpu(), want_out, **tol)
    torch.testing.assert_close(s.float().cpu(), want_state, **tol)
    args = [torch.cat([b[i] for b in batch]) for i in range(5)]
    states = torch.stack([b[5] for b in batch])
    want_out, want_states = gd.decode_step(*args, states)
    out, s = fla_forms.decode_step(*(cuda(a) for a in args[:3]), args[3].cuda(), args[4].cuda(),
                                   states.cuda())
    torch.testing.assert_close(out.float().cpu(), want_out, **tol)
    torch.testing.assert_close(s.float().cpu(), want_states, **tol)


def test_the_varlen_forms_equal_one_call_per_sequence():
    """Sequences of 1, 2, 5 and 70 tokens laid end to end (one shorter than the conv's
    state): one convolution and one chunk-form call equal a call per sequence."""
    counts = [5, 1, 70, 2]
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    q, k, v, g, beta, _ = _inputs(starts[-1], seed=21)
    states = torch.stack([_inputs(1, seed=30 + i)[5] for i in range(len(counts))])
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(starts[-1], 12, generator=gen)
    weight = torch.randn(12, 4, generator=gen)
    conv_states = torch.randn(len(counts), 12, 3, generator=gen)
    seg = gd.Segments(starts, torch.device("cpu"))
    y, conv_new = gd.causal_conv_varlen(x, weight, conv_states, seg)
    out, finals = gd.chunked_varlen(q, k, v, g, beta, states, seg)
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        want_y, want_conv = gd.causal_conv(x[a:b], weight, conv_states[i])
        torch.testing.assert_close(y[a:b], want_y, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(conv_new[i], want_conv)
        want_out, want_state = gd.chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], states[i])
        torch.testing.assert_close(out[a:b], want_out)
        torch.testing.assert_close(finals[i], want_state)
