"""The model registry (pocketllm/families.py): read without torch, every path it names real."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pocketllm.families import BY_ARCHITECTURE, BY_GGUF, FAMILIES
from test_layering import imports

ROOT = Path(__file__).resolve().parent.parent


def test_declarations_import_without_torch():
    # torch set to None makes any import of it fail, however indirect.
    code = ("import sys; sys.modules['torch'] = None\n"
            "import pocketllm.families, pocketllm.model_info, pocketllm.protocol.chat\n"
            "assert not any(m.startswith('pocketllm.workers') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_control_plane_names_the_worker_only_by_string():
    names = imports(ROOT / "pocketllm" / "families.py", "pocketllm")
    assert not any(n.startswith(("pocketllm.workers", "torch")) for n in names), names


def test_every_declared_path_resolves():
    pytest.importorskip("torch")
    from pocketllm.model_info import ModelInfo
    from pocketllm.workers.models.base import CausalLM
    from pocketllm.workers.models.registry import resolve

    for family in FAMILIES:
        for arch in family.architectures:  # each parser accepts every name it is declared for
            info = ModelInfo(path="", format="dummy", architecture=arch, family=family.name,
                             hf_config={}, vocab_size=0, max_model_len=0, eos_token_ids=[],
                             eos_source="none")
            assert issubclass(resolve(info, "model"), CausalLM), arch
            assert resolve(info, "config_parser")({}, arch).architecture == arch


def test_names_are_unique_and_templates_exist():
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    assert len(BY_ARCHITECTURE) == sum(len(f.architectures) for f in FAMILIES)
    assert len(BY_GGUF) == sum(f.gguf_architecture is not None for f in FAMILIES)
    for family in FAMILIES:
        if family.template is not None:
            assert (ROOT / "pocketllm" / "templates" / family.template).is_file()
            assert family.template_stop
        assert set(family.text_tower) <= set(family.architectures)
