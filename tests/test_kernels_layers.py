"""Triton RMSNorm (+ residual), rotary, gated activation, KV write and the one-row
products (gemv, with the norm or activation before them fused in) against the torch
layers they replace (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest

from kernel_modules import compiled_only, load_kernels

K, DEVICE = load_kernels()
import torch  # noqa: E402

from pocketllm.workers.layers.activation import act_and_mul, get_activation  # noqa: E402
from pocketllm.workers.layers.norm import RMSNorm  # noqa: E402
from pocketllm.workers.layers.rotary import RotaryTable, apply_rotary  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def reference_norm(dim, eps, seed):
    norm = RMSNorm(dim, eps, DEVICE)
    with torch.no_grad():
        norm.weight.copy_(rand(dim, seed=seed) * 0.5 + 1)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 100])
def test_add_rms_norm_matches_layer(dtype, dim):
    norm = reference_norm(dim, 1e-6, seed=1)
    x, residual = rand(7, dim, dtype=dtype, seed=2), rand(7, dim, dtype=dtype, seed=3)
    out, new_residual = K.rmsnorm.add_rms_norm(x, residual, norm.weight, norm.eps)
    expected_residual = x + residual  # in the model dtype, as the decoder layers add
    # Bit-exact when compiled; the interpreter truncates float32 -> bfloat16 (1 ulp).
    exact = DEVICE.type == "cuda" or dtype == torch.float32
    torch.testing.assert_close(new_residual, expected_residual, atol=0,
                               rtol=0 if exact else 2 ** -7)
    with torch.no_grad():
        torch.testing.assert_close(out, norm(expected_residual), **TOL[dtype])
        # the layer's own add() (torch on CPU, this kernel on CUDA) computes the same pair
        layer_out, layer_residual = norm.add(x, residual)
        torch.testing.assert_close(layer_residual, expected_residual, atol=0, rtol=0)
        torch.testing.assert_close(layer_out, norm(expected_residual), **TOL[dtype])
        torch.testing.assert_close(K.rmsnorm.rms_norm(x, norm.weight, norm.eps), norm(x),
                                   **TOL[dtype])


def test_rms_norm_per_head_on_a_fused_projection_view():
    # Qwen3/Gemma3 q_norm: [T, H, D] heads taken out of a wider qkv row (strided view)
    norm = reference_norm(16, 1e-6, seed=4)
    qkv = rand(5, 3 * 4 * 16, seed=5)
    q = qkv[:, :64].view(5, 4, 16)
    with torch.no_grad():
        torch.testing.assert_close(K.rmsnorm.rms_norm(q, norm.weight, norm.eps), norm(q),
                                   **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_reference_on_qkv_views(dtype):
    heads, kv_heads, dim, tokens = 4, 2, 32, 6
    table = RotaryTable(dim, {"rope_theta": 10000.0}, 64, DEVICE, dtype)
    positions = torch.tensor([0, 1, 5, 17, 3, 40], device=DEVICE)
    cos, sin = table.lookup(positions, 40)
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=6)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    got_q, got_k = K.rotary.apply_rotary_qk(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(got_q, expected_q, **TOL[dtype])
    torch.testing.assert_close(got_k, expected_k, **TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_with_qk_norms_matches_norm_then_rotary(dtype):
    # Qwen3 / Gemma 3: each head RMS-normed (its own weight for q and k), then rotated
    heads, kv_heads, dim, tokens = 4, 2, 32, 5
    table = RotaryTable(dim, {"rope_theta": 10000.0}, 64, DEVICE, dtype)
    cos, sin = table.lookup(torch.tensor([0, 3, 9, 30, 2], device=DEVICE), 40)
    q_norm, k_norm = reference_norm(dim, 1e-6, seed=40), reference_norm(dim, 1e-6, seed=41)
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=42) * 3
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    with torch.no_grad():
        expected_q = apply_rotary(q_norm(q), cos, sin)
        expected_k = apply_rotary(k_norm(k), cos, sin)
        got_q, got_k = K.rotary.apply_rotary_qk(q, k, cos, sin,
                                                (q_norm.weight, k_norm.weight, q_norm.eps))
    assert got_q.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(got_q, expected_q, **TOL[dtype])
    torch.testing.assert_close(got_k, expected_k, **TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)  # v untouched
    with pytest.raises(ValueError, match="norm weights"):
        K.rotary.apply_rotary_qk(q, k, cos, sin, (q_norm.weight[:8], k_norm.weight, 1e-6))


@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_on_gated_query_views(dtype, norms):
    # Qwen3.5's gated attention: each query head sits beside its output gate in q_proj's
    # row, a quarter of each head rotates (the rest passes through, normed when q/k norms)
    heads, kv_heads, dim, tokens = 4, 2, 48, 5
    table = RotaryTable(dim, {"rope_theta": 10000.0, "partial_rotary_factor": 0.25}, 64,
                        DEVICE, dtype)
    cos, sin = table.lookup(torch.tensor([0, 3, 9, 30, 2], device=DEVICE), 40)
    assert cos.shape[-1] == dim // 8  # 12 of 48 dimensions rotate
    q_norm, k_norm = reference_norm(dim, 1e-6, seed=43), reference_norm(dim, 1e-6, seed=44)
    qkv = rand(tokens, (2 * heads + 2 * kv_heads) * dim, dtype=dtype, seed=45) * 3
    q_gate = qkv[:, :2 * heads * dim].view(tokens, heads, 2 * dim)
    q = q_gate[..., :dim]
    k = qkv[:, 2 * heads * dim:(2 * heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    gate_before, v_before = q_gate[..., dim:].clone(), qkv[:, (2 * heads + kv_heads) * dim:].clone()
    with torch.no_grad():
        expected_q = apply_rotary(q_norm(q) if norms else q, cos, sin)
        expected_k = apply_rotary(k_norm(k) if norms else k, cos, sin)
        got_q, got_k = K.rotary.apply_rotary_qk(
            q, k, cos, sin, (q_norm.weight, k_norm.weight, q_norm.eps) if norms else None)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(got_q, expected_q, **TOL[dtype])
    torch.testing.assert_close(got_k, expected_k, **TOL[dtype])
    assert torch.equal(q_gate[..., dim:], gate_before)  # the gates untouched
    assert torch.equal(qkv[:, (2 * heads + kv_heads) * dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_gate_matches_torch_on_gated_query_views(dtype):
    # Qwen3.5's attention output gate: the gates are strided views of q_proj's row
    heads, dim, tokens = 4, 48, 5
    q_gate = rand(tokens, heads, 2 * dim, dtype=dtype, seed=46) * 4
    gate = q_gate[..., dim:]
    x = rand(tokens, heads, dim, dtype=dtype, seed=47)
    expected = x * torch.sigmoid(gate)
    got = K.gated_act.sigmoid_gate_(x, gate)
    assert got.data_ptr() == x.data_ptr()  # in place
    # torch's roundings when compiled; the interpreter truncates float32 -> bfloat16 instead
    # of rounding, twice (an ulp or two)
    ulps = 1 if DEVICE.type == "cuda" or dtype == torch.float32 else 4
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=ulps * 2 ** -8)
    with pytest.raises(ValueError, match="unit stride"):
        K.gated_act.sigmoid_gate_(x, gate[:, :2])


@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activation_matches_layer(hidden_act, dtype):
    gate_up = rand(5, 2 * 1500, dtype=dtype, seed=7) * 3  # 1500: two column blocks, ragged
    expected = act_and_mul(get_activation(hidden_act), gate_up)
    torch.testing.assert_close(K.gated_act.act_and_mul(gate_up, hidden_act), expected,
                               **TOL[dtype])


def test_gated_activation_refuses_unknown():
    from pocketllm.errors import UnsupportedFeatureError

    with pytest.raises(UnsupportedFeatureError):
        K.gated_act.act_and_mul(rand(2, 8), "relu2")


GEMV_CONFIG = (8, 32, 1)  # small blocks: several programs and K chunks at test sizes
GEMV_SHAPES = [(40, 96), (37, 130)]  # even, and ragged in both N and K


def _linear(x, weight, bias):
    return torch.nn.functional.linear(x, weight, bias)


def assert_product_close(got, expected, dtype):
    """Element-wise in float32; in bfloat16 as a whole (a sum that cancels rounds
    to a large relative error in one element, whichever kernel computes it)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, **TOL[dtype])
    else:
        err = (got.double() - expected.double()).norm() / expected.double().norm()
        assert err < 1e-2, f"relative error {float(err):.1e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", GEMV_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(dtype, n, k, with_bias):
    weight, x = rand(n, k, dtype=dtype, seed=20), rand(1, k, dtype=dtype, seed=21)
    bias = rand(n, dtype=dtype, seed=22) if with_bias else None
    got = K.gemv.gemv(x, weight, bias, config=GEMV_CONFIG)
    assert got.shape == (1, n) and got.dtype == dtype
    assert_product_close(got, _linear(x, weight, bias), dtype)
    logits = K.gemv.gemv(x, weight, out_dtype=torch.float32, config=GEMV_CONFIG)
    assert logits.dtype == torch.float32  # the LM head's float32 logits, no extra cast
    assert_product_close(logits, _linear(x.float(), weight.float(), None), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", GEMV_SHAPES)
def test_norm_gemv_matches_norm_then_linear(dtype, n, k):
    norm = reference_norm(k, 1e-6, seed=23)
    weight, bias = rand(n, k, dtype=dtype, seed=24), rand(n, dtype=dtype, seed=25)
    x, residual = rand(1, k, dtype=dtype, seed=26), rand(1, k, dtype=dtype, seed=27)
    with torch.no_grad():
        got, new_residual = K.gemv.norm_gemv(x, residual, norm.weight, norm.eps, weight, bias,
                                             config=GEMV_CONFIG)
        out, expected_residual = K.rmsnorm.add_rms_norm(x, residual, norm.weight, norm.eps)
        # the same rounding as the fused norm kernel (bit-exact residual) ...
        assert torch.equal(new_residual, expected_residual)
        assert_product_close(got, _linear(out, weight, bias), dtype)
        # ... and as the torch layers
        assert_product_close(got, _linear(norm(x + residual), weight, bias), dtype)
        first, same_x = K.gemv.norm_gemv(x, None, norm.weight, norm.eps, weight, bias,
                                         config=GEMV_CONFIG)
        assert same_x is x  # the first layer: no residual yet, x becomes it
        assert_product_close(first, _linear(norm(x), weight, bias), dtype)
        # the router's form: the normed row itself comes back too, for the experts
        normed = torch.empty_like(x)
        again, _ = K.gemv.norm_gemv(x, residual, norm.weight, norm.eps, weight, bias,
                                    config=GEMV_CONFIG, normed_out=normed)
        assert torch.equal(again, got)
        # bit-exact when compiled; the interpreter truncates float32 -> bfloat16 (1 ulp)
        exact = DEVICE.type == "cuda" or dtype == torch.float32
        torch.testing.assert_close(normed, out, atol=0 if exact else 1e-2,
                                   rtol=0 if exact else 2 ** -7)
        with pytest.raises(ValueError, match="normed_out"):
            K.gemv.norm_gemv(x, residual, norm.weight, norm.eps, weight, bias,
                             normed_out=torch.empty(1, k + 1, dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("n,k,pre", [(64, 2048, ""), (48, 1024, "silu"), (40, 512, "add_norm")])
def test_gemv_default_tiles_match_linear(n, k, pre):
    # the tiles the launch picks by shape (a narrow product takes two rows a program)
    dtype = torch.bfloat16
    weight, res = rand(n, k, dtype=dtype, seed=30), rand(1, k, dtype=dtype, seed=31)
    x = rand(1, 2 * k if pre == "silu" else k, dtype=dtype, seed=32)
    with torch.no_grad():
        if pre == "silu":
            got = K.gemv.gated_gemv(x, weight, None, "silu")
            expected = _linear(act_and_mul(get_activation("silu"), x), weight, None)
        elif pre:
            norm = reference_norm(k, 1e-6, seed=33)
            got = K.gemv.norm_gemv(x, res, norm.weight, norm.eps, weight)[0]
            expected = _linear(norm(x + res), weight, None)
        else:
            got, expected = K.gemv.gemv(x, weight), _linear(x, weight, None)
    assert_product_close(got, expected, dtype)


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 32), (torch.bfloat16, 32),
                                       (torch.float32, 12)])  # 12: half a head is 6 rows
def test_norm_gemv_rotates_q_and_k_as_the_rotary_kernel_does(dtype, dim):
    heads, kv_heads, k = 4, 2, 96
    n = (heads + 2 * kv_heads) * dim
    norm = reference_norm(k, 1e-6, seed=30)
    weight, bias = rand(n, k, dtype=dtype, seed=31), rand(n, dtype=dtype, seed=32)
    x, residual = rand(1, k, dtype=dtype, seed=33), rand(1, k, dtype=dtype, seed=34)
    table = RotaryTable(dim, {"rope_theta": 10000.0}, 64, DEVICE, dtype)
    cos, sin = table.lookup(torch.tensor([37], device=DEVICE), 37)
    # the plain launch at the tile the rotary one narrows to: the same sums, in the same order
    tile = (K.gemv.rotary_block_n(GEMV_CONFIG[0], dim), *GEMV_CONFIG[1:])
    with torch.no_grad():
        plain, plain_residual = K.gemv.norm_gemv(x, residual, norm.weight, norm.eps, weight,
                                                 bias, config=tile)
        q = plain[:, :heads * dim].reshape(1, heads, dim).clone()
        kk = plain[:, heads * dim:(heads + kv_heads) * dim].reshape(1, kv_heads, dim).clone()
        K.rotary.apply_rotary_qk(q, kk, cos, sin)
        rotated, new_residual = K.gemv.norm_gemv(
            x, residual, norm.weight, norm.eps, weight, bias,
            rotary=(cos, sin, dim, (heads + kv_heads) * dim), config=GEMV_CONFIG)
    expected = torch.cat([q.reshape(1, -1), kk.reshape(1, -1),
                          plain[:, (heads + kv_heads) * dim:]], dim=1)
    # the same rounding as the two kernels it replaces: equal up to the sums' order
    torch.testing.assert_close(rotated, expected, **TOL[dtype])
    assert torch.equal(rotated[:, (heads + kv_heads) * dim:], plain[:, (heads + kv_heads) * dim:])
    assert torch.equal(new_residual, plain_residual)
    with pytest.raises(ValueError, match="tile"):
        K.gemv.norm_gemv(x, residual, norm.weight, norm.eps, weight[:n - 2], None,
                         rotary=(cos, sin, dim, (heads + kv_heads) * dim), config=GEMV_CONFIG)


@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_gemv_matches_activation_then_linear(hidden_act, dtype):
    n, k = GEMV_SHAPES[1]
    weight = rand(n, k, dtype=dtype, seed=28)
    gate_up = rand(1, 2 * k, dtype=dtype, seed=29) * 3
    expected = _linear(act_and_mul(get_activation(hidden_act), gate_up), weight, None)
    got = K.gemv.gated_gemv(gate_up, weight, None, hidden_act, config=GEMV_CONFIG)
    assert_product_close(got, expected, dtype)


def test_gemv_refuses_what_it_does_not_compute():
    from pocketllm.errors import UnsupportedFeatureError

    weight = rand(8, 16)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        K.gemv.gemv(rand(9, 16), weight)
    with pytest.raises(ValueError, match="features"):
        K.gemv.gemv(rand(1, 12), weight)
    with pytest.raises(UnsupportedFeatureError):
        K.gemv.gated_gemv(rand(1, 32), weight, None, "relu2")


def test_kv_write_scatters_rows_and_skips_negative_slots():
    kv_heads, dim = 3, 24
    qkv = rand(5, 5 * kv_heads * dim, seed=8)  # k/v as strided views of a fused row
    k = qkv[:, :kv_heads * dim].view(5, kv_heads, dim)
    v = qkv[:, kv_heads * dim:2 * kv_heads * dim].view(5, kv_heads, dim)
    k_cache = torch.full((40, kv_heads, dim), float("nan"), device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.tensor([9, 2, -1, 33, 0], dtype=torch.int32, device=DEVICE)
    K.kv_write.write_kv(k, v, k_cache, v_cache, slots)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot], k[row]) and torch.equal(v_cache[slot], v[row])
    untouched = [s for s in range(40) if s not in (9, 2, 33, 0)]
    assert torch.isnan(k_cache[untouched]).all() and torch.isnan(v_cache[untouched]).all()


@pytest.mark.parametrize("family", [
    "llama", "qwen3", compiled_only("gemma3", reason="its kernels run interpreted in "
                                    "test_gpu_path_with_sliding_cache_groups_matches_torch")])
def test_gpu_path_of_a_whole_model_matches_torch(family):
    """Every kernel of the GPU path at once (attention, KV write, fused residual norms,
    rotary, activation), compiled on CUDA or interpreted here: greedy decoding gives the
    torch path's tokens and logprobs."""
    from unittest import mock

    import pocketllm.workers.kernels as kernels
    from test_worker_parity import GREEDY_LP, PROMPT, make_runner
    from tiny_checkpoints import PlanDriver, make_tiny_checkpoint

    def greedy(runner):
        driver = PlanDriver(runner)
        driver.add("r", PROMPT, GREEDY_LP, 8)
        tokens = driver.run()["r"]
        return tokens, [lp.logprob for lp in driver.reqs["r"].logprobs]

    path = make_tiny_checkpoint(family)
    with mock.patch.object(kernels, "kernels_usable", lambda device: False):
        torch_tokens, torch_logprobs = greedy(make_runner(path, DEVICE.type))
    with mock.patch.object(kernels, "kernels_usable", lambda device: True):
        runner = make_runner(path, DEVICE.type)
    assert type(runner.backend).__name__ == "TritonAttention"
    assert runner.model.layers[0].input_layernorm.add_kernel is not None
    assert runner.model.layers[0].mlp.down_proj.gated_gemv is not None  # one-row decode steps
    tokens, logprobs = greedy(runner)
    assert tokens == torch_tokens
    # float32 either way; compiled reductions may sum in another order than torch's
    assert logprobs == pytest.approx(torch_logprobs, abs=1e-5 if DEVICE.type == "cpu" else 1e-4)


def test_gpu_path_with_sliding_cache_groups_matches_torch():
    """Gemma 3's sliding layers in their own pool, driven by the real scheduler (blocks
    behind the window freed and reused, prefix hits, 16-token chunks): the Triton kernels
    read each layer's own group's tables and give the torch path's tokens."""
    from unittest import mock

    import pocketllm.workers.kernels as kernels
    from test_sliding_window_cache import Engine, make_runner, shared_prefix_workload
    from tiny_checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint("gemma3")
    kw = dict(num_kv_blocks=64, max_num_batched_tokens=16)
    with mock.patch.object(kernels, "kernels_usable", lambda device: False):
        want = shared_prefix_workload(Engine(make_runner(path, device=DEVICE.type, **kw)))
    with mock.patch.object(kernels, "kernels_usable", lambda device: True):
        runner = make_runner(path, device=DEVICE.type, **kw)
    assert type(runner.backend).__name__ == "TritonAttention" and len(runner.kv.pools) == 2
    engine = Engine(runner)
    assert shared_prefix_workload(engine) == want
    assert engine.cached["c"] == 28 and engine.most_sliding_blocks == 3  # 7 blocks shared


def test_pdl_is_on_for_hopper_gpus_only_and_can_be_turned_off(monkeypatch):
    """Programmatic dependent launch (kernels/pdl.py): the launch option goes with the
    kernels' PDL flag, on a GPU of compute capability 9 or more, unless POCKETLLM_PDL=0."""
    pdl = K.pdl
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}  # the interpreter too
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_capable", lambda index: False)
    assert pdl.launch_options(cuda) == {"PDL": False}
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    assert pdl.launch_options(cuda) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("POCKETLLM_PDL", "0")
    assert pdl.launch_options(cuda) == {"PDL": False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [(2, 4, 16, 8), (4, 8, 32, 64)])
def test_gated_delta_decode_kernel_matches_the_torch_step(dtype, dims):
    """The two-launch decode step (``gated_delta_decode``) against the layer's torch step:
    three steps of three sequences at scattered slots, outputs and both states; the
    other slots untouched."""
    from pocketllm.workers.layers.linear_attention import GatedDeltaNet
    from pocketllm.workers.models.qwen3_5_config import GdnSpec

    k_heads, v_heads, k_dim, v_dim = dims
    layer = GatedDeltaNet(48, GdnSpec(k_heads, v_heads, k_dim, v_dim, 4), 1e-6, DEVICE, dtype)
    with torch.no_grad():
        for i, p in enumerate(layer.parameters()):
            p.copy_(rand(*p.shape, seed=10 + i) * (0.3 if p.dim() > 1 else 1.0))
    conv_shape, state_shape = layer.state_shapes()
    conv = rand(6, *conv_shape, dtype=dtype, seed=1) * 0.5
    states = rand(6, *state_shape, seed=2) * 0.1
    conv_ref, states_ref = conv.clone(), states.clone()
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    kernel, layer.fused_decode = K.gated_delta_decode.decode, None
    # bfloat16: the torch step rounds the convolution's products, the kernel its sums; the
    # norm of an 8-wide head output magnifies that
    tol = (dict(atol=8e-2, rtol=5e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5))
    for step in range(3):
        proj = rand(3, sum(layer.widths), dtype=dtype, seed=20 + step)
        want = layer._decode(proj, conv_ref, states_ref, slots)
        got = kernel(proj, layer.widths, layer.conv_weight, conv, states, slots, layer.A_log,
                     layer.dt_bias, layer.norm_weight, k_heads, k_dim, 1e-6)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        torch.testing.assert_close(conv.float(), conv_ref.float(), **tol)
        torch.testing.assert_close(states, states_ref, **tol)
