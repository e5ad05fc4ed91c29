"""Models by name (``pocketllm/hub.py``): Hugging Face ids resolved to local files through
``huggingface_hub``'s own cache, laid out on disk here as it lays it out (refs, snapshots,
blobs), with no network: ids, revisions and quantization tags, which files a repository
serves, offline and unreachable-Hub failures, incomplete snapshots, local-path priority,
split GGUF files as one model, the served name and ``pocketllm download``. The README's
commands for a Hub model run only where huggingface.co answers."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys

import pytest

from pocketllm import hub
from pocketllm.config import EngineArgs
from pocketllm.errors import CheckpointError
from pocketllm.model_info import load_model_info

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
SHA = "0123456789abcdef0123456789abcdef01234567"
SHA2 = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline (as ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1``
    set it; huggingface_hub reads both at import, so its constants are set here too)."""
    from huggingface_hub import constants

    root = tmp_path / "hf_cache"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def cache_repo(cache, repo_id: str, files: dict, commit: str = SHA, refs=("main",)) -> str:
    """``repo_id``'s snapshot ``commit`` in the cache: each file a blob named by its hash,
    linked from the snapshot (``files``: repo path -> bytes, or a local file to copy)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    snap = repo / "snapshots" / commit
    for name, content in files.items():
        data = content if isinstance(content, bytes) else open(content, "rb").read()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    return str(snap)


def tiny_files(src: str) -> dict:
    return {name: os.path.join(src, name) for name in os.listdir(src)
            if os.path.isfile(os.path.join(src, name))}


@pytest.fixture(scope="module")
def tiny_llama():
    from tiny_checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint("llama")


# --- names -------------------------------------------------------------------------------

def test_ids_tags_and_what_is_not_an_id():
    assert hub.parse("Qwen/Qwen3-8B") == hub.HubRef("Qwen/Qwen3-8B")
    assert hub.parse("unsloth/Qwen3-8B-GGUF:q4_k_m") == hub.HubRef("unsloth/Qwen3-8B-GGUF", "q4_k_m")
    assert hub.parse("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q8_0").name == \
        "bartowski/Llama-3.2-1B-Instruct-GGUF:Q8_0"
    assert hub.parse("https://huggingface.co/Qwen/Qwen3-0.6B").repo_id == "Qwen/Qwen3-0.6B"
    for not_id in ("/abs/path", "./rel/dir", "model.gguf", "a/b/c", "~/x/y", "org/"):
        assert hub.parse(not_id) is None, not_id


def test_quant_tags_are_read_from_file_names():
    cases = {"Qwen3-8B-Q4_K_M.gguf": "Q4_K_M", "qwen2.5-7b-instruct-q8_0-00001-of-00003.gguf": "Q8_0",
             "Llama-3.2-1B-Instruct-IQ4_XS.gguf": "IQ4_XS", "model.BF16.gguf": "BF16",
             "Qwen3-30B-A3B-UD-Q4_K_XL.gguf": "UD-Q4_K_XL", "Q4_K_M/Qwen3-Q4_K_M.gguf": "Q4_K_M",
             "model-f16.gguf": "F16", "weights.gguf": None}
    for name, tag in cases.items():
        assert hub.quant_tag(name) == tag, name


# --- which files a repository serves -------------------------------------------------------

SAFETENSORS_REPO = ["config.json", "generation_config.json", "tokenizer.json",
                    "tokenizer_config.json", "model-00001-of-00002.safetensors",
                    "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                    "pytorch_model.bin", "original/consolidated.00.pth", "README.md",
                    "chat_template.jinja", "consolidated.safetensors", "optimizer.pt"]
GGUF_REPO = ["README.md", "config.json", "M-Q4_K_M.gguf", "M-Q8_0.gguf", "M-IQ4_XS.gguf",
             "mmproj-M-F16.gguf", "BF16/M-BF16-00001-of-00002.gguf",
             "BF16/M-BF16-00002-of-00002.gguf"]


def test_a_safetensors_repository_serves_only_what_serving_reads():
    files, main = hub.select(SAFETENSORS_REPO, hub.HubRef("o/m"))
    assert main == "" and sorted(files) == sorted(
        ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
         "model.safetensors.index.json", "chat_template.jinja"])
    assert hub.select(SAFETENSORS_REPO, hub.HubRef("o/m"), config_only=True)[0] == [
        f for f in SAFETENSORS_REPO if f.endswith(".json") and "/" not in f]


def test_a_tag_picks_one_gguf_model_case_blind():
    assert hub.select(GGUF_REPO, hub.HubRef("o/m", "q8_0")) == (["M-Q8_0.gguf"], "M-Q8_0.gguf")
    files, main = hub.select(GGUF_REPO, hub.HubRef("o/m", "bf16"))  # a split set: every part
    assert main == "BF16/M-BF16-00001-of-00002.gguf" and files == [
        "BF16/M-BF16-00001-of-00002.gguf", "BF16/M-BF16-00002-of-00002.gguf"]
    assert hub.select(GGUF_REPO, hub.HubRef("o/m"))[1] == "M-Q4_K_M.gguf"  # llama.cpp's default
    with pytest.raises(CheckpointError, match="no GGUF file for the tag 'Q5_K_S'; its tags: "
                                              "BF16, IQ4_XS, Q4_K_M, Q8_0"):
        hub.select(GGUF_REPO, hub.HubRef("o/m", "Q5_K_S"))
    without_default = [f for f in GGUF_REPO if "Q4_K_M" not in f]
    with pytest.raises(CheckpointError, match="several GGUF models; name one with a tag"):
        hub.select(without_default, hub.HubRef("o/m"))


def test_a_repository_of_both_serves_safetensors_unless_a_tag_is_given():
    both = SAFETENSORS_REPO + ["m-Q4_K_M.gguf"]
    assert hub.select(both, hub.HubRef("o/m"))[1] == ""
    assert hub.select(both, hub.HubRef("o/m", "Q4_K_M"))[1] == "m-Q4_K_M.gguf"
    with pytest.raises(CheckpointError, match="no GGUF files for the tag 'Q4_K_M'; drop the tag"):
        hub.select(SAFETENSORS_REPO, hub.HubRef("o/m", "Q4_K_M"))
    with pytest.raises(CheckpointError, match="holds no safetensors or GGUF weights .*\\.bin"):
        hub.select(["config.json", "pytorch_model.bin"], hub.HubRef("o/m"))


# --- resolution through the cache ------------------------------------------------------------

def test_an_id_in_the_cache_serves_offline_with_its_revision(cache, tiny_llama):
    snap = cache_repo(cache, "tiny-org/tiny-llama", tiny_files(tiny_llama))
    info = load_model_info(EngineArgs(model="tiny-org/tiny-llama", device="cpu"))
    assert info.path == snap and info.format == "safetensors" and info.family == "llama"
    assert (info.hub_id, info.revision) == ("tiny-org/tiny-llama", SHA)
    from pocketllm.server.serve import default_model_name

    assert default_model_name(EngineArgs(model="tiny-org/tiny-llama")) == "tiny-org/tiny-llama"
    # another revision: a branch, and a commit named directly
    snap2 = cache_repo(cache, "tiny-org/tiny-llama", tiny_files(tiny_llama), SHA2, refs=("v2",))
    assert hub.resolve("tiny-org/tiny-llama", "v2").path == snap2
    assert hub.resolve("tiny-org/tiny-llama", SHA2).commit == SHA2
    with pytest.raises(CheckpointError, match="at revision 'v3' is not in the Hugging Face cache"):
        hub.resolve("tiny-org/tiny-llama", "v3")


def test_the_library_serves_an_id_from_the_cache(cache, tiny_llama):
    """``LLM(EngineArgs(model=ID))``: the same tokens as the local directory."""
    from pocketllm import LLM, SamplingParams

    cache_repo(cache, "tiny-org/tiny-llama", tiny_files(tiny_llama))
    params = SamplingParams(max_tokens=6, temperature=0)
    outs = []
    for model in ("tiny-org/tiny-llama", tiny_llama):
        with LLM(EngineArgs(model=model, device="cpu", seed=0)) as llm:
            outs.append(llm.generate("hello world", params)[0].token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 6


def test_offline_and_not_cached_names_the_id_and_the_cache(cache):
    with pytest.raises(CheckpointError) as e:
        load_model_info(EngineArgs(model="nobody/nothing-GGUF:Q4_K_M"))
    text = str(e.value)
    assert "'nobody/nothing-GGUF:Q4_K_M' is not in the Hugging Face cache" in text
    assert str(cache) in text and "HF_HUB_OFFLINE is set" in text and "\n" not in text
    assert "pocketllm download nobody/nothing-GGUF:Q4_K_M" in text


def test_an_unreachable_hub_falls_back_to_the_cache(cache, tiny_llama, monkeypatch, caplog):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as s:  # a port nothing listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    snap = cache_repo(cache, "tiny-org/tiny-llama", tiny_files(tiny_llama))
    assert hub.resolve("tiny-org/tiny-llama").path == snap
    assert "cannot reach the Hugging Face Hub" in caplog.text
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache .* and the Hugging "
                                              "Face Hub cannot be reached"):
        hub.resolve("tiny-org/elsewhere")


def _hub_error(cls):
    e = cls.__new__(cls)  # their constructors want an HTTP response
    Exception.__init__(e, "from the Hub")
    return e


@pytest.mark.parametrize("error,message", [
    ("GatedRepoError", "'o/m' is gated: accept its terms on https://huggingface.co/o/m and "
                       "set HF_TOKEN"),
    ("RepositoryNotFoundError", "no model 'o/m' on the Hugging Face Hub \\(a private one needs "
                                "HF_TOKEN\\)"),
    ("RevisionNotFoundError", "'o/m' has no revision 'v9'")])
def test_the_hubs_answers_are_one_line_each(cache, monkeypatch, error, message):
    import huggingface_hub
    from huggingface_hub import constants, errors

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def refuse(self, repo_id, revision=None):
        raise _hub_error(getattr(errors, error))

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", refuse)
    with pytest.raises(CheckpointError, match=message):
        hub.resolve("o/m", "v9")


def test_online_only_the_files_serving_reads_are_fetched_at_the_listed_commit(cache, monkeypatch):
    """The Hub's listing of the revision (mocked: no network here) decides the files;
    ``snapshot_download`` fetches exactly those, at the commit the listing named."""
    import types

    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    listing = types.SimpleNamespace(sha=SHA2, siblings=[types.SimpleNamespace(rfilename=f)
                                                        for f in GGUF_REPO])
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info",
                        lambda self, repo_id, revision=None: listing)
    calls = []

    def fetch(repo_id, revision=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision, allow_patterns, kw))
        return str(cache / "snap")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetch)
    got = hub.resolve("hf.co/o/m:bf16", "main")
    assert calls == [("o/m", SHA2, ["BF16/M-BF16-00001-of-00002.gguf",
                                    "BF16/M-BF16-00002-of-00002.gguf"], {})]
    assert got.path == str(cache / "snap" / "BF16" / "M-BF16-00001-of-00002.gguf")
    assert (got.commit, got.ref.name) == (SHA2, "o/m:bf16")


def test_an_incomplete_snapshot_is_not_served(cache, tiny_llama):
    files = tiny_files(tiny_llama)
    files["model.safetensors.index.json"] = (
        b'{"weight_map": {"a": "model-00001-of-00002.safetensors", '
        b'"b": "model-00002-of-00002.safetensors"}}')
    files["model-00001-of-00002.safetensors"] = files.pop("model.safetensors")
    cache_repo(cache, "tiny-org/half", files)
    with pytest.raises(CheckpointError, match="incomplete in the Hugging Face cache \\(no "
                                              "model-00002-of-00002.safetensors\\)"):
        hub.resolve("tiny-org/half")


def test_a_local_path_comes_first_and_takes_no_revision(cache, tiny_llama, tmp_path, monkeypatch):
    local = tmp_path / "tiny-org" / "tiny-llama"
    shutil.copytree(tiny_llama, local)
    cache_repo(cache, "tiny-org/tiny-llama", tiny_files(tiny_llama))
    monkeypatch.chdir(tmp_path)
    info = load_model_info(EngineArgs(model="tiny-org/tiny-llama"))
    assert info.path == "tiny-org/tiny-llama" and info.hub_id is None
    with pytest.raises(CheckpointError, match="revision applies to a Hugging Face id"):
        load_model_info(EngineArgs(model="tiny-org/tiny-llama", revision="main"))
    with pytest.raises(CheckpointError, match="checkpoint not found: .*neither a local path"):
        load_model_info(EngineArgs(model="./no/such/dir"))


def test_a_revision_is_a_name():
    from pocketllm.errors import InvalidRequestError

    for bad in ("", "main branch", "x" * 300, 7, "v1;rm"):
        with pytest.raises(InvalidRequestError, match="revision must name a branch"):
            EngineArgs(revision=bad)
    EngineArgs(revision="refs/pr/12")


def test_several_hosts_need_a_pinned_commit(cache, tiny_llama):
    cache_repo(cache, "tiny-org/tiny-llama", tiny_files(tiny_llama))
    args = dict(model="tiny-org/tiny-llama", tensor_parallel_size=2, nnodes=2, master_port=29500)
    with pytest.raises(CheckpointError, match="needs --revision set to a commit"):
        load_model_info(EngineArgs(**args))
    assert load_model_info(EngineArgs(**args, revision=SHA)).revision == SHA


# --- split GGUF files ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def split_gguf(tmp_path_factory):
    """The tiny Qwen3.5 checkpoint through llama.cpp's converter, whole and split in parts
    of eight tensors (its Llama and Qwen3 conversions need sentencepiece)."""
    from llama_cpp_convert import convert
    from tiny_checkpoints import make_tiny_checkpoint

    hf = make_tiny_checkpoint("qwen3_5")
    out = tmp_path_factory.mktemp("split")
    (out / "whole").mkdir()
    (out / "split").mkdir()
    whole = convert(hf, str(out / "whole" / "tiny.gguf"), "q8_0", "--no-mtp")
    convert(hf, str(out / "split" / "tiny.gguf"), "q8_0", "--no-mtp", "--split-max-tensors", "8")
    parts = sorted(os.listdir(out / "split"))
    assert len(parts) > 2 and all(re.search(r"-\d{5}-of-\d{5}\.gguf$", p) for p in parts), parts
    return whole, [str(out / "split" / p) for p in parts]


def test_a_split_gguf_is_one_model(split_gguf, cache):
    from family_parity import run
    from test_worker_parity import PROMPT, make_runner

    whole, parts = split_gguf
    got, got_driver = run(make_runner(parts[0]), {"r": PROMPT}, new_tokens=8)
    want, want_driver = run(make_runner(whole), {"r": PROMPT}, new_tokens=8)
    assert got["r"] == want["r"]
    assert [lp.logprob for lp in got_driver.reqs["r"].logprobs] == \
        [lp.logprob for lp in want_driver.reqs["r"].logprobs]
    # the torch-free CPU worker (what a CPU serves a GGUF with) reads the parts too
    from pocketllm.workers.lite.runner import LiteRunner

    args = EngineArgs(model=parts[0], device="cpu", num_kv_blocks=64, block_size=16,
                      max_num_seqs=4)
    lite, lite_driver = run(LiteRunner(load_model_info(args), args), {"r": PROMPT}, new_tokens=8)
    args = EngineArgs(model=whole, device="cpu", num_kv_blocks=64, block_size=16, max_num_seqs=4)
    lite_whole, whole_driver = run(LiteRunner(load_model_info(args), args), {"r": PROMPT},
                                   new_tokens=8)
    assert lite["r"] == lite_whole["r"]
    assert [lp.logprob for lp in lite_driver.reqs["r"].logprobs] == \
        [lp.logprob for lp in whole_driver.reqs["r"].logprobs]
    from pocketllm.tokenizer.tokenizer import load_tokenizer  # the vocabulary: the first part's

    text = "hello split world"
    assert load_tokenizer(load_model_info(EngineArgs(model=parts[0]))).tokenizer.encode(text).ids \
        == load_tokenizer(load_model_info(EngineArgs(model=whole))).tokenizer.encode(text).ids
    with pytest.raises(CheckpointError, match="load its first part"):
        load_model_info(EngineArgs(model=parts[1]))
    # through the cache, by tag: every part is fetched and the first one loaded
    files = {f"Q8_0/{os.path.basename(p).replace('tiny', 'tiny-Q8_0')}": p for p in parts}
    snap = cache_repo(cache, "tiny-org/tiny-GGUF", files)
    info = load_model_info(EngineArgs(model="tiny-org/tiny-GGUF:q8_0"))
    assert info.format == "gguf" and info.path == os.path.join(
        snap, "Q8_0", os.path.basename(parts[0]).replace("tiny", "tiny-Q8_0"))
    os.remove(os.path.join(snap, sorted(files)[-1]))  # a part missing: refused, by name
    with pytest.raises(CheckpointError, match="incomplete in the Hugging Face cache"):
        load_model_info(EngineArgs(model="tiny-org/tiny-GGUF:q8_0"))


# --- the command line ----------------------------------------------------------------------------

def test_download_fails_in_one_line_with_exit_1(cache, capsys, tiny_llama):
    from pocketllm.cli import main

    assert main(["download", "nobody/nothing"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("pocketllm: error: 'nobody/nothing' is not in the Hugging Face cache")
    assert len(err.splitlines()) == 1
    snap = cache_repo(cache, "tiny-org/tiny-llama", tiny_files(tiny_llama))
    assert main(["download", "tiny-org/tiny-llama"]) == 0
    assert capsys.readouterr().out.strip() == snap


def test_serve_serves_an_id_under_its_name(cache, tiny_llama):
    """``pocketllm serve ID`` from the cache: /v1/models says the id, and a completion runs."""
    import httpx

    from server_process import ServerProcess

    cache_repo(cache, "tiny-org/tiny-llama", tiny_files(tiny_llama))
    server = ServerProcess("tiny-org/tiny-llama", "--device", "cpu")  # HF_* from the fixture
    try:
        models = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["tiny-org/tiny-llama"]
        done = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny-org/tiny-llama", "prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()


def test_serve_fails_in_one_line_with_exit_1_offline(cache):
    """``pocketllm serve ID`` offline with the model not cached: one line, exit 1, and
    nothing written to the cache."""
    from server_process import free_port
    from test_readme_newcomer import _one_error_line

    out = subprocess.run([sys.executable, "-m", "pocketllm", "serve", "nobody/nothing-GGUF:Q8_0",
                          "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    line = _one_error_line(out)
    assert "'nobody/nothing-GGUF:Q8_0' is not in the Hugging Face cache" in line
    assert str(cache) in line and os.listdir(cache) == []


def test_a_stop_while_fetching_exits_at_once(tmp_path):
    """Ctrl-C while the Hub is being asked (here a port that takes the connection and
    never answers): the server exits at once, exit 0, not after the download."""
    import signal
    import time

    from server_process import free_port

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # never accepted: every request waits
    env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{silent.getsockname()[1]}",
               HF_HUB_OFFLINE="0", HF_HUB_CACHE=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "pocketllm", "serve", "slow-org/slow-model",
                             "--port", str(free_port())], env=env, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while "loading slow-org/slow-model" not in proc.stderr.readline():
            assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(1.0)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - stopped < 20
        assert "stopped while fetching slow-org/slow-model" in proc.stderr.read()
    finally:
        proc.kill()
        silent.close()


def test_serve_takes_the_model_as_its_argument():
    from pocketllm.cli import build_parser

    ns = build_parser().parse_args(["serve", "Qwen/Qwen3-0.6B", "--revision", "main"])
    assert (ns.model_arg, ns.revision) == ("Qwen/Qwen3-0.6B", "main")


def readme_hub_lines() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        block = next(b for b in re.findall(r"```bash\n(.*?)```", f.read(), re.S)
                     if "pocketllm download" in b)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_the_readmes_hub_commands_parse():
    from pocketllm.cli import build_parser

    lines = readme_hub_lines()
    assert any(" serve " in f" {line} " for line in lines)
    for line in lines:
        argv = shlex.split(line)
        assert argv[0] == "pocketllm"
        ns = build_parser().parse_args(argv[1:])
        model = getattr(ns, "model_arg", None) or ns.model
        assert hub.parse(model) is not None, line


def _hub_reachable() -> bool:
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.network
@pytest.mark.skipif(not _hub_reachable(), reason="needs network: huggingface.co")
def test_the_readmes_hub_commands_fetch(tmp_path):
    """Each README id through ``pocketllm download``, into a fresh cache."""
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="0")
    for line in readme_hub_lines():
        model = shlex.split(line)[2]
        done = subprocess.run([sys.executable, "-m", "pocketllm", "download", model], env=env,
                              capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-2000:]
        assert os.path.exists(done.stdout.strip().splitlines()[-1])
