"""`--model` takes a Hugging Face id: resolved through huggingface_hub's cache, offline here.

The cache is filled by the test in the layout huggingface_hub writes (blobs, snapshots/<commit> with
links to them, refs/<revision>), so nothing is downloaded; HF_HUB_OFFLINE=1 makes any miss an error.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

REPO = "google/diffusiongemma-26B-A4B-it"


def fill_cache(hub_cache, repo_id: str, folder, revision: str = "main") -> str:
    """Put every file of `folder` into `hub_cache` as huggingface_hub stores a snapshot; returns the commit."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in folder.iterdir() if p.is_file())
    commit = hashlib.sha1(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for p in files:
        data = p.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / p.name
        if not link.exists():
            link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_model_dir):
    home = tmp_path_factory.mktemp("hf-home")
    fill_cache(home / "hub", REPO, tiny_model_dir)
    fill_cache(home / "hub", REPO, tiny_model_dir, revision="v1")
    return home


def dgemma(hf_home, *args):
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "dgemma", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_info_and_generate_from_a_hub_id_offline(hf_home, tiny_model_dir):
    info = dgemma(hf_home, "info", "--model", REPO)
    assert info.returncode == 0, info.stderr
    assert "headers match the index and the file sizes" in info.stdout
    args = ("generate", "--prompt", "hello world", "--max-new-tokens", "16", "--seed", "3")
    by_id = dgemma(hf_home, *args, "--model", REPO, "--revision", "v1")
    local = dgemma(hf_home, *args, "--model", str(tiny_model_dir))
    assert by_id.returncode == 0, by_id.stderr
    assert by_id.stdout == local.stdout and by_id.stdout.strip()


@pytest.mark.parametrize("args,message", [
    (("--model", "google/not-in-the-cache"), "not in the Hugging Face cache"),
    (("--model", REPO, "--revision", "v2"), "not in the Hugging Face cache"),
    (("--model", "no/such/folder"), "no such model folder"),
])
def test_missing_ids_are_one_line_and_exit_2(hf_home, args, message):
    proc = dgemma(hf_home, "info", *args)
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


def test_revision_with_a_local_folder_is_refused(hf_home, tiny_model_dir):
    proc = dgemma(hf_home, "info", "--model", str(tiny_model_dir), "--revision", "main")
    assert proc.returncode == 2 and "--revision applies to Hugging Face ids" in proc.stderr


def test_serve_names_the_model_by_its_id(hf_home):
    """A server started from an id answers /v1/models with that id, not the snapshot folder's hash."""
    import httpx

    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dgemma", "serve", "--model", REPO, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = ""
        while "http://" not in line:
            line = proc.stdout.readline()
            assert line, "server exited"
        url = line[line.index("http://"):].split()[0].rstrip("/")
        models = httpx.get(f"{url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [REPO]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
