"""`ninfer pull`: pinning, sha256 checks and offline behaviour, against fake hub caches.

No test reaches the network. HF_HUB_OFFLINE=1 is set for every test (huggingface_hub reads
it into `constants.HF_HUB_OFFLINE` at import, so the constant is patched too); the few tests
that need "online but no network" point the endpoint at a closed port on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import socket
import time
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from ninfer_core.cli.main import main

REPO = "org/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"
WEIGHTS = b"not really safetensors\n" * 100
CONFIG = b'{"architectures": ["Qwen3ForCausalLM"]}\n'


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fake_cache(root, repo=REPO, commit=COMMIT, files=None, ref="main"):
    """A folder laid out as huggingface_hub's cache: blobs, snapshot links, a ref."""
    files = {"model.safetensors": WEIGHTS, "config.json": CONFIG} if files is None else files
    storage = root / f"models--{repo.replace('/', '--')}"
    for name, data in files.items():
        # LFS blobs are named by their sha256, small git files by a git sha1.
        blob_name = (
            sha256(data) if name.endswith(".safetensors") else hashlib.sha1(data).hexdigest()
        )
        blob = storage / "blobs" / blob_name
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = storage / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(f"../../blobs/{blob_name}")
    if ref:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / ref).write_text(commit)  # no newline, as the hub writes it
    return storage


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def no_network(monkeypatch):
    """Online mode, with the Hub at a port on 127.0.0.1 that refuses connections.

    The 23 s huggingface_hub spends on an unreachable Hub are sleeps between retries, so
    `time.sleep` fails the test: "fails at once" is checked without timing anything.
    """
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(
            constants,
            "HUGGINGFACE_CO_URL_TEMPLATE",
            endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        )

        def no_retries(seconds):
            raise AssertionError(f"slept {seconds}s: something retried")

        monkeypatch.setattr(time, "sleep", no_retries)
        yield endpoint


def pull(capsys, cache, *args):
    code = main(["pull", REPO, "--dir", str(cache), *args])
    out, err = capsys.readouterr()
    return code, out, err


# --- pinned commits ----------------------------------------------------------------------


def test_pinned_commit_resolves_offline_and_prints_the_path(tmp_path, capsys):
    storage = fake_cache(tmp_path)
    code, out, err = pull(capsys, tmp_path, "--revision", COMMIT, "--file", "config.json")
    assert code == 0, err
    assert out == f"{storage / 'snapshots' / COMMIT / 'config.json'}\n"  # the path and only it
    assert Path(out.strip()).read_bytes() == CONFIG


def test_pinned_commit_ignores_where_main_points(tmp_path, capsys):
    fake_cache(tmp_path, commit=OTHER, files={"config.json": b"{}"})
    fake_cache(tmp_path)  # refs/main now names COMMIT; OTHER stays in snapshots/
    code, out, err = pull(capsys, tmp_path, "--revision", OTHER, "--file", "config.json")
    assert code == 0, err
    assert f"/snapshots/{OTHER}/config.json" in out


def test_cached_pin_needs_no_request(tmp_path, capsys, no_network):
    fake_cache(tmp_path)
    code, out, err = pull(capsys, tmp_path, "--revision", COMMIT, "--file", "config.json")
    assert code == 0, err
    assert out.strip().endswith(f"{COMMIT}/config.json")


def test_upper_case_sha_is_a_pin(tmp_path, capsys):
    fake_cache(tmp_path)
    code, out, err = pull(capsys, tmp_path, "--revision", COMMIT.upper(), "--file", "config.json")
    assert code == 0, err
    assert COMMIT in out


def test_default_cache_is_hf_hub_cache(tmp_path, capsys, monkeypatch):
    fake_cache(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    code = main(["pull", REPO, "--revision", COMMIT, "--file", "config.json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith(str(tmp_path))


# --- refusing unpinned revisions ---------------------------------------------------------


@pytest.mark.parametrize("name", ["main", "v1"])
def test_branch_or_tag_is_refused(tmp_path, capsys, name):
    fake_cache(tmp_path)
    code, out, err = pull(capsys, tmp_path, "--revision", name, "--file", "config.json")
    assert code == 1 and out == ""
    assert err.count("\n") == 1  # one line, no traceback
    assert f"pin a commit: `--revision {name}` is a branch or tag name" in err
    assert "a newer upload could change what you get" in err
    assert "--allow-unpinned" in err


def test_short_sha_is_refused(tmp_path, capsys):
    fake_cache(tmp_path)
    code, _, err = pull(capsys, tmp_path, "--revision", COMMIT[:7], "--file", "config.json")
    assert code == 1
    assert "short commit sha (7 of 40 hex digits)" in err


def test_allow_unpinned_resolves_main_from_refs_offline(tmp_path, capsys):
    storage = fake_cache(tmp_path)
    code, out, err = pull(
        capsys, tmp_path, "--revision", "main", "--allow-unpinned", "--file", "config.json"
    )
    assert code == 0, err
    assert out == f"{storage / 'snapshots' / COMMIT / 'config.json'}\n"
    assert f"main is commit {COMMIT}; pin it with --revision {COMMIT}" in err


# --- sha256 ------------------------------------------------------------------------------


def test_sha256_match(tmp_path, capsys):
    fake_cache(tmp_path)
    digest = sha256(WEIGHTS)
    code, out, err = pull(
        capsys,
        tmp_path,
        "--revision",
        COMMIT,
        "--file",
        "model.safetensors",
        "--sha256",
        digest.upper(),
    )
    assert code == 0, err
    assert out.strip().endswith("model.safetensors")
    assert f"sha256 ok ({digest})" in err


def test_sha256_mismatch_names_both_digests_and_removes_the_file(tmp_path, capsys):
    storage = fake_cache(tmp_path)
    link = storage / "snapshots" / COMMIT / "model.safetensors"
    blob = link.resolve()
    wrong = sha256(b"something else")
    code, out, err = pull(
        capsys, tmp_path, "--revision", COMMIT, "--file", "model.safetensors", "--sha256", wrong
    )
    assert code == 1 and out == ""
    assert f"expected {wrong}, found {sha256(WEIGHTS)}" in err
    assert "removed" in err and "check the expected digest" in err  # the blob is the Hub's file
    # Neither the snapshot entry nor its blob is left to be used again.
    assert not link.exists() and not link.is_symlink()
    assert not blob.exists()
    code, _, err = pull(capsys, tmp_path, "--revision", COMMIT, "--file", "model.safetensors")
    assert code == 1 and "not in the local cache" in err


@pytest.mark.parametrize(
    "digest", ["xyz", "ab" * 31, "g" * 64, "ab" * 33], ids=["word", "62-hex", "non-hex", "66-hex"]
)
def test_invalid_sha256_fails_before_any_lookup(tmp_path, capsys, digest):
    # The file is not cached, so an error about the cache would mean a lookup happened first.
    code, out, err = pull(
        capsys, tmp_path, "--revision", COMMIT, "--file", "config.json", "--sha256", digest
    )
    assert code == 1 and out == ""
    assert f"--sha256 {digest!r} is not a sha256 digest (64 hex digits" in err


# --- no network --------------------------------------------------------------------------


def test_not_cached_offline_fails_with_a_clear_message(tmp_path, capsys):
    fake_cache(tmp_path)
    code, out, err = pull(capsys, tmp_path, "--revision", COMMIT, "--file", "tokenizer.json")
    assert code == 1 and out == ""
    assert err == (
        f"ninfer pull: error: {REPO}@{COMMIT}: tokenizer.json is not in the local cache "
        "and HF_HUB_OFFLINE=1 forbids downloading\n"
    )


def test_unreachable_hub_fails_at_once(tmp_path, capsys, no_network):
    code, out, err = pull(capsys, tmp_path, "--revision", COMMIT, "--file", "config.json")
    assert code == 1 and out == ""
    assert f"{REPO}@{COMMIT}: config.json is not in the local cache" in err
    assert f"the Hub at {no_network} cannot be reached (ConnectError" in err
    assert err.count("\n") == 1


def test_unreachable_hub_falls_back_to_a_cached_branch(tmp_path, capsys, no_network):
    fake_cache(tmp_path)
    code, out, err = pull(
        capsys, tmp_path, "--revision", "main", "--allow-unpinned", "--file", "config.json"
    )
    assert code == 0, err
    assert out.strip().endswith(f"{COMMIT}/config.json")
    assert "the Hub is unreachable; using the cached main, which may be out of date" in err


# --- what the Hub answers ----------------------------------------------------------------


def _http_error(cls, status):
    request = httpx2.Request("HEAD", "https://huggingface.co/x")
    return cls("hub says no", response=httpx2.Response(status, request=request))


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (
            _http_error(RepositoryNotFoundError, 404),
            f"repository {REPO} not found (if it is private",
        ),
        (_http_error(GatedRepoError, 403), f"{REPO} is gated: accept its terms"),
        (_http_error(RevisionNotFoundError, 404), f"{REPO} has no revision {COMMIT}"),
        (_http_error(RemoteEntryNotFoundError, 404), f"{REPO}@{COMMIT} has no file config.json"),
        (_http_error(HfHubHTTPError, 500), "config.json: the Hub answered 500: hub says no"),
    ],
    ids=["repo-not-found", "gated", "no-revision", "no-file", "http-500"],
)
def test_hub_errors_become_one_line(tmp_path, capsys, monkeypatch, no_network, error, message):
    def answer(url, **kwargs):
        raise error

    monkeypatch.setattr("ninfer_core.hub.get_hf_file_metadata", answer)
    code, out, err = pull(capsys, tmp_path, "--revision", COMMIT, "--file", "config.json")
    assert code == 1 and out == ""
    assert message in err
    assert err.count("\n") == 1


# --- never outside the cache -------------------------------------------------------------


def test_sha256_mismatch_never_deletes_outside_the_cache(tmp_path, capsys):
    cache = tmp_path / "cache"
    storage = fake_cache(cache)
    outside = tmp_path / "precious.bin"
    outside.write_bytes(WEIGHTS)
    link = storage / "snapshots" / COMMIT / "model.safetensors"
    link.unlink()
    link.symlink_to(outside)  # a snapshot entry pointing out of the cache
    wrong = sha256(b"something else")
    code, out, err = pull(
        capsys, cache, "--revision", COMMIT, "--file", "model.safetensors", "--sha256", wrong
    )
    assert code == 1 and out == "" and err.count("\n") == 1
    assert outside.read_bytes() == WEIGHTS  # the target outside the cache is untouched
    assert not link.is_symlink()  # the link, which is in the cache, is gone
    assert f"left {outside} alone (outside the cache)" in err


def test_sha256_mismatch_in_a_snapshot_folder_linked_outside_keeps_it(tmp_path, capsys):
    cache = tmp_path / "cache"
    storage = fake_cache(cache, files={"config.json": CONFIG})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_bytes(CONFIG)
    snapshot = storage / "snapshots" / COMMIT
    for entry in snapshot.iterdir():
        entry.unlink()
    snapshot.rmdir()
    snapshot.symlink_to(elsewhere, target_is_directory=True)
    code, _, err = pull(
        capsys, cache, "--revision", COMMIT, "--file", "config.json", "--sha256", "0" * 64
    )
    assert code == 1 and "removed nothing" in err
    assert (elsewhere / "config.json").read_bytes() == CONFIG


@pytest.mark.parametrize(
    "name", ["../x", "/etc/passwd", ".", "", "..", "a/../../x", "a//b", "a\\b", "sub/", "C:x"]
)
def test_bad_file_names_are_refused_in_one_line(tmp_path, capsys, name):
    fake_cache(tmp_path)
    code, out, err = pull(capsys, tmp_path, "--revision", COMMIT, "--file", name)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "is not a file name in a repo" in err, err


def test_sha256_mismatch_removes_a_plain_file_entry_and_says_nothing_was_outside(tmp_path, capsys):
    storage = fake_cache(tmp_path, files={"config.json": CONFIG})
    entry = storage / "snapshots" / COMMIT / "config.json"
    entry.unlink()
    entry.write_bytes(CONFIG)  # caches without symlinks hold plain files
    code, _, err = pull(
        capsys, tmp_path, "--revision", COMMIT, "--file", "config.json", "--sha256", "0" * 64
    )
    assert code == 1 and not entry.exists()
    assert f"removed {entry} from the cache" in err and "outside" not in err


@pytest.mark.parametrize("repo", ["../../etc", "a b", "x" * 1000, "", "a/b/c"])
def test_bad_repo_ids_are_refused_in_one_line(tmp_path, capsys, repo):
    code = main(["pull", repo, "--dir", str(tmp_path), "--revision", COMMIT, "--file", "x.json"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "is not a Hub repo id" in err and len(err) < 300, err
