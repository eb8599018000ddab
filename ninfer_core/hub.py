"""Fetching one file from the Hugging Face Hub, pinned to a commit and optionally verified.

`pull()` is what `ninfer pull` runs. The download itself is `huggingface_hub.hf_hub_download`
into a hub cache folder (`HF_HUB_CACHE`, or the caller's), so a file fetched once is found
again offline and is shared with transformers and the `hf` CLI. What this module adds:

- the revision must be a full commit sha, unless the caller accepts an unpinned name;
- with a sha256, the file is hashed after the download; a mismatch is removed from the cache;
- a machine without network fails at once: hf_hub_download retries an unreachable Hub for
  ~23 s, so one HEAD request without retries goes first;
- huggingface_hub's exceptions become one-line `PullError`s.

Interrupted downloads: within one call hf_hub_download retries a dropped connection and
continues from the bytes it has (an HTTP Range request). A partial file from a killed process
is not reused by huggingface_hub 2.x: each download writes a process-unique `*.incomplete`
file, which it deletes on failure. Nothing here touches those files or forces a download.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath

import httpx2  # huggingface_hub 2.x's HTTP client: its connection and timeout errors
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from ninfer_core.errors import NInferError, elided

COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
HEX = re.compile(r"[0-9a-fA-F]+")

#: Bytes read per step while hashing, so a 20 GB file never sits in memory.
HASH_CHUNK = 1 << 20


class PullError(NInferError):
    """A file could not be fetched or verified; the message names the repo, revision and file."""


class HubUnreachable(PullError):
    """The Hub cannot be reached (no network, a timeout) and the file is not cached."""


@dataclass(frozen=True)
class Pulled:
    """Where the file is, and what was checked on the way."""

    path: Path
    #: The commit the file came from (a branch or tag resolved), or None where unknown.
    commit: str | None
    #: The verified digest, or None when no `sha256` was given.
    sha256: str | None
    #: A line for the user when something was settled for them (a cached ref used offline).
    note: str | None = None


def check_revision(revision: str, *, allow_unpinned: bool = False) -> str:
    """The revision to ask for: a full commit sha, or any name when `allow_unpinned`."""
    if COMMIT_SHA.fullmatch(revision.lower()):
        return revision.lower()  # the Hub's commit shas are lower case
    if allow_unpinned:
        return revision
    if HEX.fullmatch(revision) and len(revision) < 40:
        what = f"looks like a short commit sha ({len(revision)} of 40 hex digits)"
    else:
        what = "is a branch or tag name; a newer upload could change what you get"
    raise PullError(
        f"pin a commit: `--revision {revision}` {what}. Give the full 40-hex commit sha "
        "(the repo's history on the Hub lists it), or pass --allow-unpinned to accept"
    )


def check_repo_id(repo_id: str) -> str:
    """`repo_id` when the Hub would take it (`namespace/name`, its characters and length),
    else a PullError that says so in one line (huggingface_hub's own check raises outside
    anything a caller catches, with the whole id echoed)."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise PullError(
            f"{elided(repo_id)!r} is not a Hub repo id: give 'namespace/name' (letters, "
            "digits, '-', '_' and '.', at most 96 characters a part), e.g. Qwen/Qwen3-0.6B"
        ) from None
    return repo_id


def check_filename(filename: str) -> str:
    """`filename` when it names a file inside a repo: a relative POSIX path with no empty,
    `.` or `..` part. huggingface_hub refuses some of these with a traceback and resolves
    others (`.`, '') to the snapshot folder itself, so they are refused here first."""
    parts = filename.split("/")
    if (
        not filename
        or filename.startswith("/")
        or "\\" in filename
        or "\0" in filename
        or any(part in ("", ".", "..") for part in parts)
        or PureWindowsPath(parts[0]).drive
    ):
        raise PullError(
            f"--file {filename!r} is not a file name in a repo: give a relative path such as "
            "config.json or onnx/model.onnx, without '.', '..', empty parts or backslashes"
        )
    return filename


def check_sha256(digest: str) -> str:
    """`digest` in lower case, or a PullError when it is not 64 hex digits."""
    if not (len(digest) == 64 and HEX.fullmatch(digest)):
        raise PullError(
            f"--sha256 {digest!r} is not a sha256 digest (64 hex digits, as `sha256sum` prints)"
        )
    return digest.lower()


def file_sha256(path: Path) -> str:
    """The file's sha256, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def pull(
    repo_id: str,
    filename: str,
    *,
    revision: str,
    sha256: str | None = None,
    allow_unpinned: bool = False,
    cache_dir: str | Path | None = None,
) -> Pulled:
    """Fetch `filename` of `repo_id` at `revision` into the hub cache and return its path.

    A pinned file already in the cache is returned without any network request. Offline
    (`HF_HUB_OFFLINE=1`) only the cache is used, and a branch or tag resolves through the
    cache's `refs/`. Raises PullError for anything the user can fix.
    """
    repo_id = check_repo_id(repo_id)
    filename = check_filename(filename)
    revision = check_revision(revision, allow_unpinned=allow_unpinned)
    expected = check_sha256(sha256) if sha256 is not None else None
    where = f"{repo_id}@{revision}"
    pinned = COMMIT_SHA.fullmatch(revision) is not None
    offline = constants.is_offline_mode()

    def fetch(local_only: bool) -> Path:
        with _hub_errors(where, filename):
            try:
                found = hf_hub_download(
                    repo_id,
                    filename,
                    revision=revision,
                    cache_dir=cache_dir,
                    local_files_only=local_only,
                )
            except httpx2.TransportError as exc:  # mid-download, after hf_hub_download's retries
                raise PullError(
                    f"{where}: {filename}: the download failed ({type(exc).__name__}: "
                    f"{_first_line(exc)}); run it again"
                ) from exc
        return Path(found)

    # A commit never changes, so a cached copy of it is the answer, found without a request.
    # A branch is looked up in the cache only offline: online, the Hub says where it is now.
    storage = _storage(repo_id, cache_dir)
    if pinned or offline:
        try:
            return _verified(fetch(local_only=True), expected, where, filename, storage)
        except LocalEntryNotFoundError:
            if offline:
                raise PullError(
                    f"{where}: {filename} is not in the local cache and HF_HUB_OFFLINE=1 "
                    "forbids downloading"
                ) from None
    try:
        commit = _ask_hub(repo_id, filename, revision, where)
    except HubUnreachable as unreachable:
        if pinned:
            raise
        # Unpinned: a cached copy of the branch beats nothing, which is what hf_hub_download
        # itself would settle for after its retries.
        try:
            path = fetch(local_only=True)
        except LocalEntryNotFoundError:
            raise unreachable from None
        note = f"the Hub is unreachable; using the cached {revision}, which may be out of date"
        return _verified(path, expected, where, filename, storage, note=note)
    return _verified(fetch(local_only=False), expected, where, filename, storage, commit=commit)


def _storage(repo_id: str, cache_dir: str | Path | None) -> Path:
    """The repo's folder in the hub cache (`<cache>/models--org--name`): nothing outside
    it is ever removed."""
    from huggingface_hub.file_download import repo_folder_name

    root = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    return root / repo_folder_name(repo_id=repo_id, repo_type="model")


def _verified(
    path: Path,
    expected: str | None,
    where: str,
    filename: str,
    storage: Path,
    *,
    commit: str | None = None,
    note: str | None = None,
) -> Pulled:
    if not path.is_file():
        raise PullError(f"{where}: {filename} is not a file in the cache ({path})")
    if expected is not None:
        _verify(path, expected, where, filename, storage)
    return Pulled(path=path, commit=commit or _snapshot_commit(path), sha256=expected, note=note)


def _ask_hub(repo_id: str, filename: str, revision: str, where: str) -> str | None:
    """One HEAD request without retries: the commit `revision` is at now.

    Raises HubUnreachable at once when there is no network, and PullError when the Hub
    answers that the repo, revision or file does not exist.
    """
    url = hf_hub_url(repo_id, filename, revision=revision)
    try:
        with _hub_errors(where, filename):
            return get_hf_file_metadata(url, retry_on_errors=False).commit_hash
    except httpx2.TransportError as exc:
        raise HubUnreachable(
            f"{where}: {filename} is not in the local cache and the Hub at "
            f"{constants.ENDPOINT} cannot be reached ({type(exc).__name__}: {_first_line(exc)})"
        ) from exc


@contextmanager
def _hub_errors(where: str, filename: str) -> Iterator[None]:
    """Turns huggingface_hub's exceptions into one-line PullErrors.

    A cache miss (LocalEntryNotFoundError) and a network failure (httpx2.TransportError) pass
    through: what they mean depends on the caller.
    """
    repo_id, _, revision = where.partition("@")
    login = "log in with `hf auth login` or set HF_TOKEN"
    try:
        yield
    except LocalEntryNotFoundError:
        raise
    # Subclasses before their bases: GatedRepoError is a RepositoryNotFoundError, the HTTP
    # errors are HfHubHTTPErrors, and HfHubHTTPError is an OSError.
    except GatedRepoError as exc:
        raise PullError(f"{repo_id} is gated: accept its terms on the Hub, then {login}") from exc
    except RepositoryNotFoundError as exc:
        raise PullError(f"repository {repo_id} not found (if it is private, {login})") from exc
    except RevisionNotFoundError as exc:
        raise PullError(f"{repo_id} has no revision {revision}") from exc
    except EntryNotFoundError as exc:
        raise PullError(f"{where} has no file {filename}") from exc
    except HfHubHTTPError as exc:
        answer = f"the Hub answered {exc.response.status_code}: {_first_line(exc)}"
        raise PullError(f"{where}: {filename}: {answer}") from exc
    except OfflineModeIsEnabled as exc:
        raise PullError(f"{where}: {filename}: HF_HUB_OFFLINE=1 forbids asking the Hub") from exc
    except HFValidationError as exc:
        raise PullError(f"{repo_id!r}: {_first_line(exc)}") from exc
    except OSError as exc:  # a short download, a full disk, an unwritable cache folder
        raise PullError(f"{where}: {filename}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _snapshot_commit(path: Path) -> str | None:
    """The commit of a file in the hub cache: `.../snapshots/<commit>/<file>`."""
    parts = path.parts
    for at, part in enumerate(parts[:-2]):
        if part == "snapshots" and COMMIT_SHA.fullmatch(parts[at + 1]):
            return parts[at + 1]
    return None


def _verify(path: Path, expected: str, where: str, filename: str, storage: Path) -> None:
    """Hash `path`; on a mismatch remove it from the cache and raise.

    Only what lies inside the repo's cache folder `storage` is removed: the snapshot entry
    when its folder really is in `storage`, and the blob it links to when that is in
    `storage/blobs`. A link pointing elsewhere loses the link, never its target.
    """
    found = file_sha256(path)
    if found == expected:
        return
    linked, blob = path.is_symlink(), path.resolve()
    # The snapshot entry is a link to a blob named by its etag; with the blob left behind
    # the next pull would link it again without downloading. Both go.
    removed, kept = [], []
    if _inside(path.parent.resolve(), storage / "snapshots"):
        path.unlink(missing_ok=True)  # the link itself (or a plain file) in the snapshot
        removed.append(str(path))
    else:
        kept.append(str(path))
    if linked:
        if _inside(blob, storage / "blobs"):
            blob.unlink(missing_ok=True)
        else:
            kept.append(str(blob))
    hint = ""
    if blob.name == found:  # an LFS blob is named by its sha256: the Hub's copy is intact
        hint = "; it is the file the Hub has at that revision, so check the expected digest"
    done = f"removed {removed[0]} from the cache" if removed else "removed nothing"
    if kept:
        done += f", left {' and '.join(kept)} alone (outside the cache)"
    raise PullError(
        f"{where}: {filename}: sha256 mismatch: expected {expected}, found {found}; {done}{hint}"
    )


def _inside(resolved: Path, folder: Path) -> bool:
    """Whether the already resolved path `resolved` lies inside `folder` (resolved here)."""
    return resolved.is_relative_to(folder.resolve())
