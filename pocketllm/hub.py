"""Models by name: a Hugging Face Hub id resolved to files on this machine.

``--model`` takes a local path first; where no such path exists, an id
``org/name`` (optionally ``hf.co/org/name``) with an optional ``:TAG`` naming a GGUF
quantization (``Q4_K_M``, ``q8_0``, ... case-blind). ``resolve`` turns it into local files
before any process starts (the worker processes never download):

- Online it asks the Hub which files the revision holds (``--revision``: a branch, tag or
  commit; default ``main``) and downloads only what serving reads, through
  ``huggingface_hub`` (its cache, ``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_TOKEN``, resumable
  downloads, progress bars). Offline (``HF_HUB_OFFLINE=1``, or the Hub unreachable) it
  serves the cached snapshot of the revision, checked complete.
- Which files: a repository with safetensors weights serves them (config, tokenizer, chat
  template, generation config and the ``*.safetensors`` at its top level; no other
  formats, no optimizer states) unless a tag is given; a tag picks the GGUF file whose
  quantization it names (a split ``-00001-of-0000N`` set is one model); a repository of
  GGUF files alone, without a tag, serves its Q4_K_M (llama.cpp's ``-hf`` default) or its
  only model.

Every failure is one line (``CheckpointError``): offline and not cached (naming the
id and the cache), gated, missing, a tag matching nothing (listing the repository's).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from dataclasses import dataclass
from typing import Optional

from .errors import CheckpointError

log = logging.getLogger("pocketllm.hub")

# org/name as the Hub spells it; optionally a URL-ish prefix and a :TAG
_ID = re.compile(r"^(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?"
                 r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})"
                 r"(?::(?P<tag>[A-Za-z0-9][\w.-]*))?$")
# A GGUF file's quantization, from its name: ...-Q4_K_M.gguf, ...-q8_0-00001-of-00002.gguf
_QUANT = re.compile(r"(?:^|[-_.])((?:UD-)?(?:I?Q\d+(?:_[A-Z0-9]+)*|BF16|F16|F32|MXFP4(?:_MOE)?))"
                    r"(?=(?:-\d{5}-of-\d{5})?\.gguf$)", re.IGNORECASE)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# What serving a safetensors repository reads, at its top level
SAFETENSORS_FILES = ("*.safetensors", "*.json", "*.jinja", "tokenizer.model")
DEFAULT_TAG = "Q4_K_M"


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    tag: Optional[str] = None

    @property
    def name(self) -> str:
        """The id as served (``/v1/models``): ``org/name`` or ``org/name:TAG``."""
        return self.repo_id + (f":{self.tag}" if self.tag else "")


@dataclass(frozen=True)
class Resolved:
    path: str  # the snapshot directory, or the (first) GGUF file in it
    ref: HubRef
    commit: str  # the revision's commit sha


def parse(model: str) -> Optional[HubRef]:
    """The Hub id ``model`` names, None if it is not one."""
    m = _ID.match(model.strip())
    return HubRef(m["repo"], m["tag"]) if m else None


def is_commit(revision: Optional[str]) -> bool:
    """Whether ``revision`` is a full commit sha (the same files wherever it is resolved)."""
    return revision is not None and re.fullmatch(r"[0-9a-f]{40}", revision) is not None


def looks_local(model: str) -> bool:
    """Whether ``model`` names an existing local path (local paths come first)."""
    return os.path.exists(os.path.expanduser(model))


def quant_tag(filename: str) -> Optional[str]:
    """The quantization a GGUF file's name carries (upper case), None if it names none."""
    m = _QUANT.search(os.path.basename(filename))
    return m.group(1).upper() if m else None


def select(files: list[str], ref: HubRef, config_only: bool = False) -> tuple[list[str], str]:
    """(the files of ``files``, repo-relative, that serving reads; the one to load: "" for
    the repository's top directory, else a GGUF file)."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf")
                   and "mmproj" not in os.path.basename(f).lower())
    top = [f for f in files if "/" not in f]
    safetensors = [f for f in top if f.endswith(".safetensors")]
    if any(not f.startswith("consolidated") for f in safetensors):  # Mistral's second copy
        top = [f for f in top if not (f.startswith("consolidated") and f.endswith(".safetensors"))]
    if ref.tag is None and safetensors:
        wanted = ["*.json"] if config_only else SAFETENSORS_FILES
        return [f for f in top if any(fnmatch.fnmatch(f, p) for p in wanted)], ""
    if not ggufs:
        if ref.tag is not None:
            raise CheckpointError(f"{ref.repo_id!r} has no GGUF files for the tag "
                                  f"{ref.tag!r}; drop the tag to serve its safetensors"
                                  if safetensors else f"{ref.repo_id!r} has no GGUF files")
        kinds = sorted({os.path.splitext(f)[1] for f in files if os.path.splitext(f)[1]})
        raise CheckpointError(f"{ref.repo_id!r} holds no safetensors or GGUF weights "
                              f"PocketLLM can serve (its files: {', '.join(kinds) or 'none'})")
    models = _gguf_models(ggufs)  # first file -> every file of that model
    tags = sorted({t for t in (quant_tag(f) for f in models) if t})
    if ref.tag is not None:
        chosen = [f for f in models if quant_tag(f) == ref.tag.upper()]
        if not chosen:
            raise CheckpointError(f"{ref.repo_id!r} has no GGUF file for the tag {ref.tag!r}; "
                                  f"its tags: {', '.join(tags) or 'none (name one of its files)'}")
    else:
        chosen = [f for f in models if quant_tag(f) == DEFAULT_TAG] or (
            list(models) if len(models) == 1 else [])
        if not chosen:
            raise CheckpointError(f"{ref.repo_id!r} holds several GGUF models; name one with a "
                                  f"tag, {ref.repo_id}:TAG (its tags: {', '.join(tags)})")
    if len(chosen) > 1:
        raise CheckpointError(f"{ref.name!r} matches several GGUF files: "
                              f"{', '.join(chosen)}")
    main = chosen[0]  # a GGUF file is its own config: dummy weights read its header too
    return list(models[main]), main


def _gguf_models(ggufs: list[str]) -> dict[str, list[str]]:
    """First file -> the files of one model: a lone file, or a split set in order."""
    models: dict[str, list[str]] = {}
    sets: dict[tuple[str, int], list[tuple[int, str]]] = {}
    for f in ggufs:
        m = _SPLIT.search(f)
        if m is None:
            models[f] = [f]
        else:
            sets.setdefault((f[:m.start()], int(m[2])), []).append((int(m[1]), f))
    for (_, count), parts in sets.items():
        parts.sort()
        models[parts[0][1]] = [f for _, f in parts]
    return models


def resolve(model: str, revision: Optional[str] = None, config_only: bool = False) -> Resolved:
    """Local files for the Hub id ``model`` (see the module docstring); ``config_only``:
    the config alone (dummy weights)."""
    ref = parse(model)
    if ref is None:
        raise CheckpointError(f"{model!r} is neither a local path nor a Hugging Face id "
                              "(org/name, optionally :QUANT)")
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:  # pragma: no cover - a dependency
        raise CheckpointError("serving a model by name needs huggingface_hub "
                              "(pip install huggingface_hub)") from None
    from huggingface_hub import constants

    online = not constants.HF_HUB_OFFLINE
    if online:
        remote = _remote_files(ref, revision)
        if remote is not None:
            commit, files = remote
            wanted, main = select(files, ref, config_only)
            folder = _download(ref, commit, wanted)
            return Resolved(os.path.join(folder, main) if main else folder, ref, commit)
    return _cached(ref, revision, config_only, online)


def _remote_files(ref: HubRef, revision: Optional[str]) -> Optional[tuple[str, list[str]]]:
    """(commit, files) of the revision on the Hub; None where the Hub cannot be reached."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        info = HfApi().model_info(ref.repo_id, revision=revision)
    except GatedRepoError:
        raise CheckpointError(f"{ref.repo_id!r} is gated: accept its terms on "
                              f"https://huggingface.co/{ref.repo_id} and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{ref.repo_id!r} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"no model {ref.repo_id!r} on the Hugging Face Hub (a private "
                              "one needs HF_TOKEN)") from None
    except Exception as e:  # the network: fall back to the cache
        log.warning("cannot reach the Hugging Face Hub (%s: %s); looking in the cache",
                    type(e).__name__, str(e).splitlines()[0][:120] if str(e) else "")
        return None
    return info.sha, [s.rfilename for s in (info.siblings or [])]


def _download(ref: HubRef, commit: str, files: list[str]) -> str:
    """Fetch ``files`` of ``commit`` into the cache (what is there already is kept; a
    download interrupted resumes); the snapshot directory."""
    from huggingface_hub import snapshot_download

    log.info("fetching %s (%s) from the Hugging Face Hub: %d files", ref.name, commit[:12],
             len(files))
    try:
        return snapshot_download(ref.repo_id, revision=commit, allow_patterns=files)
    except Exception as e:
        raise CheckpointError(f"downloading {ref.name!r} failed: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from None


def _cached(ref: HubRef, revision: Optional[str], config_only: bool, online: bool) -> Resolved:
    """The cached snapshot of the revision, checked complete for what serving reads."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    why = ("the Hugging Face Hub cannot be reached" if online else "HF_HUB_OFFLINE is set")
    try:
        folder = snapshot_download(ref.repo_id, revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        at = f" at revision {revision!r}" if revision else ""
        raise CheckpointError(f"{ref.name!r}{at} is not in the Hugging Face cache "
                              f"({constants.HF_HUB_CACHE}) and {why}: download it where "
                              f"there is network (pocketllm download {ref.name})") from None
    files = []
    for root, _, names in os.walk(folder):
        files += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    wanted, main = select(files, ref, config_only)
    missing = [f for f in _needed(folder, wanted, main) if not os.path.exists(os.path.join(folder, f))]
    if missing:
        raise CheckpointError(f"{ref.name!r} is incomplete in the Hugging Face cache (no "
                              f"{missing[0]}) and {why}: download it again")
    commit = os.path.basename(os.path.normpath(folder))
    log.info("%s: the cached snapshot %s (%s)", ref.name, commit[:12], why)
    return Resolved(os.path.join(folder, main) if main else folder, ref, commit)


def _needed(folder: str, wanted: list[str], main: str) -> list[str]:
    """The files a served snapshot must hold: a safetensors index's shards and the config,
    or every part of a split GGUF (named by its first part)."""
    if main:
        m = _SPLIT.search(main)
        if m is None:
            return [main]
        return [f"{main[:m.start()]}-{i:05d}-of-{m[2]}.gguf" for i in range(1, int(m[2]) + 1)]
    needed = ["config.json"]
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        import json

        with open(index, encoding="utf-8") as f:
            needed += sorted(set(json.load(f).get("weight_map", {}).values()))
    elif not any(f.endswith(".safetensors") for f in wanted):
        needed.append("model.safetensors")
    return needed
