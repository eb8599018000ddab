"""A GGUF file opened with gguf-py's `GGUFReader`, bounded for untrusted input.

`GGUFReader` parses the header eagerly and maps the tensor data lazily (a `numpy.memmap`).
Left as it is, a hostile header costs without bound: a metadata array claiming 2**60
elements is walked one element at a time even past the end of the file (reads there come
back empty, so the walk never advances), and every element of a numeric array becomes its
own numpy object. `BoundedReader` keeps the parsing to gguf-py and changes four things:

* a read past the end of the file is a `GGUFFormatError` ("truncated"), so every loop the
  header drives advances by at least a byte and stops at the end of the file;
* counts are capped (`MAX_KEYS`, `MAX_TENSORS`, `MAX_ARRAY`) before their loops start;
* a numeric array is one numpy view, not one object per element (the `token_type` array
  of a 150k vocabulary costs nothing), and nested arrays are refused;
* every tensor record is checked (known type, sane dims, bytes inside the file) before
  gguf-py builds its views, so a problem names the tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

#: Metadata keys, tensors, and elements of one metadata array a file may declare. A vocabulary
#: of 4M tokens (and as many merges) still fits; more is a hostile or broken header.
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 20
MAX_ARRAY = 1 << 22
#: ggml tensors have at most 4 dimensions (`GGML_MAX_DIMS`).
MAX_DIMS = 4


class GGUFFormatError(ValueError):
    """The file is not a GGUF we can read; the message is one line, without the path."""


class BoundedReader(GGUFReader):
    """`GGUFReader` whose every read, count and tensor record is checked (module docstring)."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        # gguf-py's `_get`, bounded, and slicing a plain ndarray view of the map: a memmap
        # slice pays numpy's memmap bookkeeping, most of the parse time of a 150k vocabulary.
        flat = self.__dict__.get("_flat")
        if flat is None:
            flat = self._flat = self.data.view(np.ndarray)
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        if end > len(flat):
            raise GGUFFormatError(
                f"truncated GGUF file: the header needs bytes up to {end:,}, "
                f"but the file has {len(flat):,}"
            )
        arr = flat[offset:end].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _build_fields(self, offs: int, count: int) -> int:
        if int(count) > MAX_KEYS:
            raise GGUFFormatError(f"the header declares {int(count):,} metadata keys")
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[Any]]:
        if int(count) > MAX_TENSORS:
            raise GGUFFormatError(f"the header declares {int(count):,} tensors")
        if self.byte_order == "S":
            raise GGUFFormatError("big-endian GGUF files are not supported")
        return super()._build_tensor_info(offs, count)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        if self._value_type(int(raw_type)) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        n = int(length[0])
        if n > MAX_ARRAY:
            raise GGUFFormatError(
                f"a metadata array declares {n:,} elements (at most {MAX_ARRAY:,} are read)"
            )
        if item_type[0] == GGUFValueType.ARRAY:
            raise GGUFFormatError("nested metadata arrays are not supported")
        scalar = self.gguf_scalar_to_np.get(self._value_type(int(item_type[0])))
        if scalar is None:  # strings: one (length, bytes) pair each, as gguf-py reads them
            return super()._get_field_parts(orig_offs, raw_type)
        # Numeric: one view of all n values; `ReaderField.contents()` flattens it the same.
        values = self._get(orig_offs + 12, scalar, n)
        types = [GGUFValueType.ARRAY, GGUFValueType(int(item_type[0]))]
        return 12 + int(values.nbytes), [item_type, length, values], [2], types

    @staticmethod
    def _value_type(raw: int) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFFormatError(f"unknown metadata value type {raw}") from None

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for field in fields:
            _, name_data, n_dims, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            if int(n_dims[0]) > MAX_DIMS:
                raise GGUFFormatError(f"tensor {name!r} has {int(n_dims[0])} dimensions")
            try:
                ggml_type = GGMLQuantizationType(int(raw_type[0]))
            except ValueError:
                raise GGUFFormatError(
                    f"tensor {name!r} has unknown tensor type {int(raw_type[0])}"
                ) from None
            shape = [int(d) for d in dims]  # ggml order: ne0 (the contiguous one) first
            if ggml_type not in GGML_QUANT_SIZES:
                raise GGUFFormatError(f"tensor {name!r} has unknown tensor type {ggml_type.name}")
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            numel = 1
            for d in shape:
                numel *= d
            if shape and shape[0] % block:
                raise GGUFFormatError(
                    f"tensor {name!r} ({ggml_type.name}) has a row of {shape[0]} values, "
                    f"not a multiple of its block of {block}"
                )
            begin = start_offs + int(offset[0])
            end = begin + numel // block * type_size
            if end > size:
                raise GGUFFormatError(
                    f"truncated GGUF file: tensor {name!r} needs bytes [{begin:,}, {end:,}), "
                    f"but the file has {size:,}"
                )
        super()._build_tensors(start_offs, fields)


def read_gguf(path: Path) -> BoundedReader:
    """Parse `path`'s header; any problem is a one-line `GGUFFormatError`."""
    try:
        return BoundedReader(path)
    except GGUFFormatError:
        raise
    except UnicodeDecodeError as exc:
        raise GGUFFormatError(f"a name or string in the header is not UTF-8 ({exc})") from None
    except (ValueError, KeyError, IndexError, OverflowError, TypeError) as exc:
        # gguf-py's own checks: magic, version, duplicate keys or tensors, alignment
        text = str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
        raise GGUFFormatError(f"not a readable GGUF file: {text}") from None
