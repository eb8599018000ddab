"""A Hugging Face model folder with a reduced draft head (`ninfer draft-head build hf/`).

The output is a new folder: every file of the source (a model is never changed in
place) plus `draft_head.safetensors`, holding `draft_head.weight` [N, hidden] (the head's
rows, in its stored dtype) and `draft_head.token_ids` [N] (fp32, as a `.ninfer` file
stores them). The folder reader lists every `*.safetensors` file of an unsharded folder;
a sharded folder's index is rewritten to name the new file for both tensors. Files of
`LINK_BYTES` or more (the weights) are hard-linked where the file system allows and
copied where it does not (another device); smaller ones (configs, templates) are copied,
so editing one in the copy leaves the source alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ninfer_core.spec.draft_head import TOKEN_IDS, WEIGHT

#: The file the reduced head is written to, and the index of a sharded folder.
HEAD_FILE = "draft_head.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: Files this large or larger are hard-linked (where possible) rather than copied.
LINK_BYTES = 1 << 20


def _link_or_copy(src: str, dst: str) -> str:
    if os.stat(src).st_size >= LINK_BYTES:
        try:
            os.link(src, dst)  # follows a symlink (a hub cache's snapshot) to its blob
            return dst
        except OSError:
            pass  # another device, or a file system without hard links
    return shutil.copy2(src, dst)


def _index_with_head(source: Path, nbytes: int) -> str:
    """The source's shard index with both head tensors mapped to `HEAD_FILE`."""
    index = json.loads((source / INDEX_NAME).read_text(encoding="utf-8"))
    weight_map = {k: v for k, v in index["weight_map"].items() if k not in (WEIGHT, TOKEN_IDS)}
    index["weight_map"] = {**weight_map, WEIGHT: HEAD_FILE, TOKEN_IDS: HEAD_FILE}
    metadata = index.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("total_size"), int):
        metadata["total_size"] += nbytes
    return json.dumps(index, indent=2)


def write_folder_with_draft_head(
    source: Path, out: Path, head: torch.Tensor, token_ids: list[int]
) -> None:
    """Write `out` (absent or empty): the folder `source` with the rows `token_ids` of
    `head` [vocab, hidden], in rank order, as its reduced draft head. An earlier head of
    `source` is replaced. The folder appears whole or not at all."""
    from safetensors.torch import save_file

    ids = torch.tensor(token_ids, dtype=torch.int64)
    rows = head.index_select(0, ids).contiguous()  # [N, hidden], the head's dtype
    replaced = {HEAD_FILE, INDEX_NAME}
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(
            source,
            tmp,
            copy_function=_link_or_copy,
            ignore=lambda where, names: replaced & set(names) if Path(where) == source else (),
        )
        save_file({WEIGHT: rows, TOKEN_IDS: ids.float()}, str(tmp / HEAD_FILE),
                  metadata={"format": "pt"})  # fmt: skip
        if (source / INDEX_NAME).is_file():
            nbytes = rows.numel() * rows.element_size() + ids.numel() * 4
            (tmp / INDEX_NAME).write_text(_index_with_head(source, nbytes), encoding="utf-8")
        if out.is_dir():
            out.rmdir()  # empty: checked before the build
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
