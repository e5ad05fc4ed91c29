"""The torch-free forward (workers/lite/model.py) against the torch worker on the same GGUF
files, whose blocks it dequantizes to float32: the same greedy tokens and log
probabilities within the 16-bit activations' rounding (and float32's: the prompt's rows
take SDPA and torch's ops there, the C layer here), on tiny all-block files of each
family it serves and on the embedded model."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pocketllm import EngineArgs  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.proto.messages import SamplingSpec  # noqa: E402
from pocketllm.workers.kernels import cpu_lib  # noqa: E402
from pocketllm.workers.lite.model import LiteModel, refusal, step_view  # noqa: E402
from pocketllm.workers.step_rows import ScheduledSeq  # noqa: E402
from pocketllm.workers.runner import ModelRunner  # noqa: E402
from tiny_checkpoints import PlanDriver  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_lib.available(),
                                reason=f"CPU kernels: {cpu_lib.unavailable_reason()}")

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]


def _all_block_gguf(tmp_path, family: str) -> str:
    import gguf
    from test_gguf_weights import _tiny_hf_model, write_tiny_gguf

    Q = gguf.GGMLQuantizationType
    path = str(tmp_path / f"tiny-{family}.gguf")
    write_tiny_gguf(path, family, _tiny_hf_model(family),
                    qtypes=[(Q.Q8_0, 0), (Q.Q4_0, 0), (Q.Q5_1, 0), (Q.Q4_1, 0), (Q.Q5_0, 0)])
    return path


def _torch_greedy(path: str, prompt: list[int], steps: int):
    args = EngineArgs(model=path, device="cpu", num_kv_blocks=64, block_size=16)
    driver = PlanDriver(ModelRunner(load_model_info(args), args))
    driver.add("r", prompt, SamplingSpec(temperature=0.0, logprobs=0), steps)
    tokens = driver.run()["r"]
    return tokens, [lp.logprob for lp in driver.reqs["r"].logprobs]


def _lite_greedy(path, prompt: list[int], steps: int, stack_rows: int = 0, before_step=None):
    """One sequence in blocks 0, 1, 2... of one pool (every layer's), the pad block last;
    ``path``: a GGUF file or a ``LiteModel``; ``stack_rows``: from how many rows a step
    attends by matrix products (0: the model's); ``before_step(i)`` is called before step i."""
    model = (path if isinstance(path, LiteModel)
             else LiteModel(load_model_info(EngineArgs(model=path, device="cpu"))))
    model.stack_rows = stack_rows or model.stack_rows
    cfg, bs = model.cfg, 16
    table = list(range(-(-(len(prompt) + steps) // bs)))
    pad = len(table) * bs
    caches = [tuple(np.zeros((pad + bs, cfg.num_kv_heads, cfg.head_dim), np.float32)
                    for _ in range(2)) for _ in range(cfg.num_layers)]
    model.bind(caches, [(0, w) for w in cfg.layer_windows])
    tokens, logprobs, ids = [], [], list(prompt)
    start = 0
    for i in range(steps):
        if before_step is not None:
            before_step(i)
        n = len(ids) - start
        seq = ScheduledSeq(table, start, n, 0)
        views = {(0, w): step_view([seq], w, bs, pad, n) for w in set(cfg.layer_windows)}
        logits = model.forward(np.array(ids[start:]), np.arange(start, len(ids)), views,
                               [n - 1])[0].astype(np.float64)
        token = int(logits.argmax())
        logprobs.append(float(logits[token] - logits.max()
                              - np.log(np.exp(logits - logits.max()).sum())))
        tokens.append(token)
        start = len(ids)
        ids.append(token)
    return tokens, logprobs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompt_len,stack_rows", [(24, 0), (150, 0), (150, 2)])
def test_lite_forward_matches_the_torch_worker(family, prompt_len, stack_rows, tmp_path):
    """A prompt through the C stack, and a long one through it and through attention by
    matrix products (two query blocks, past gemma3's 64-token window, so a block's run of
    keys starts inside the cache)."""
    path = _all_block_gguf(tmp_path, family)
    prompt = ([5, 6, 7, 8, 9, 40, 41, 3] * 19)[:prompt_len]
    steps = 70 if prompt_len < 64 else 20  # past gemma3's 64-token window either way
    want_tokens, want_lp = _torch_greedy(path, prompt, steps)
    tokens, lp = _lite_greedy(path, prompt, steps, stack_rows)
    assert tokens == want_tokens
    np.testing.assert_allclose(lp, want_lp, atol=2e-3)


def test_lite_forward_on_the_embedded_model(default_model_path):
    prompt = [2, 651, 6037, 529, 7001, 563]
    want_tokens, want_lp = _torch_greedy(default_model_path, prompt, 16)
    tokens, lp = _lite_greedy(default_model_path, prompt, 16)
    assert tokens == want_tokens
    np.testing.assert_allclose(lp, want_lp, atol=2e-3)


def test_lite_model_needs_no_torch(default_model_path):
    code = ("import sys; from pocketllm import EngineArgs; "
            "from pocketllm.model_info import load_model_info; "
            "from pocketllm.workers.lite.model import LiteModel; "
            f"LiteModel(load_model_info(EngineArgs(model={default_model_path!r}, device='cpu'))); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_what_the_lite_forward_refuses(tiny_llama):
    assert refusal(load_model_info(EngineArgs(model=tiny_llama))) == "not a GGUF checkpoint"


@pytest.mark.parametrize("family", FAMILIES + ["qwen3_moe"])
def test_dummy_shapes_are_the_torch_models(family, tmp_path):
    """The torch-free worker's dummy weights take their shapes from the config
    (``lite/dummy.checkpoint_shapes``): every tensor the torch model of the family loads,
    of the same shape, and no other."""
    from pocketllm.workers.lite.dummy import checkpoint_shapes
    from pocketllm.workers.models.config import arch_config
    from pocketllm.workers.models.registry import checkpoint_shapes as torch_shapes
    from tiny_checkpoints import make_tiny_checkpoint

    info = load_model_info(EngineArgs(model=make_tiny_checkpoint(family, str(tmp_path))))
    assert checkpoint_shapes(arch_config(info), info.family) == torch_shapes(info)


def _parts(model: LiteModel) -> list:
    return [p for bound in model.bound for b in bound for p in b.parts] + list(model.head.parts)


def test_dense_weights_move_onto_copies_between_steps(tmp_path, monkeypatch):
    """resident.py: each dense part is copied off the file's mapping in the background and
    adopted between steps; the copies are byte-for-byte the blocks, so the greedy tokens
    and log probabilities are bit-identical whether a step reads the mapping, the copies,
    or (mid-sequence) some of each. Without room in memory nothing is copied."""
    from pocketllm.workers.lite import resident

    path = _all_block_gguf(tmp_path, "qwen3")
    prompt = [5, 6, 7, 8, 9, 40, 41, 3]
    info = load_model_info(EngineArgs(model=path, device="cpu"))
    mapped = LiteModel(info)
    monkeypatch.setattr(resident, "HEADROOM_BYTES", 1 << 60)  # no room: stays mapped
    assert not mapped.resident.start()
    file_ptrs = [p.w for p in _parts(mapped)]
    want = _lite_greedy(mapped, prompt, 12)
    assert [p.w for p in _parts(mapped)] == file_ptrs and mapped.resident.adopted == 0

    monkeypatch.setattr(resident, "HEADROOM_BYTES", 0)
    copied = LiteModel(info)
    assert copied.resident.start()
    copied.resident.join()
    assert _lite_greedy(copied, prompt, 12) == want
    assert copied.resident.adopted == len(file_ptrs)
    assert not set(p.w for p in _parts(copied)) & set(file_ptrs)

    # adopted mid-sequence: the prompt and 3 decode steps on the mapping, the rest on the copies
    late = LiteModel(info)
    late.resident.start()
    late.resident.join()
    late.resident.adopt = lambda: None  # held back until step 4

    def release(i):
        if i == 4:
            del late.resident.adopt
    assert _lite_greedy(late, prompt, 12, before_step=release) == want
    assert late.resident.adopted == len(file_ptrs)
