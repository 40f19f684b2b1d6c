"""On-disk cache of what a GGUF model costs to prepare: its config, dequantised weights, tokenizer.

A GGUF start pays for parsing the metadata, dequantising every tensor and converting the
vocabulary into a fast tokenizer. All three results are stored under
``$FORERUN_CACHE_DIR`` (default ``~/.cache/forerun``) in one folder per GGUF file, keyed by
the file's resolved path, size and modification time, so that the next start reads a JSON
file, a safetensors file and a ``tokenizer.json`` instead.

Layout of one entry::

    <cache>/gguf/<stem>-<key>/
        source.json                  # what the entry was made from (for humans)
        hf_config.json               # gguf_hf_config() output + the chat template
        weights.<dtype>.safetensors  # the model's own parameters in that dtype
        tokenizer/                   # tokenizer.save_pretrained()

Weights are stored in the dtype the model was built in, cast from the float32 dequantised
tensors exactly as the uncached load casts them, so a cached load is bit-identical to an
uncached one in every dtype (float32 included). Each part is written atomically (temporary
name in the entry, then ``os.replace``), so a crashed writer leaves nothing half-written under
the final name. A part that cannot be read is logged at INFO, removed and rebuilt by the
slow path. ``FORERUN_CACHE_DIR=""`` (or ``off``/``0``/``none``) disables the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from forerun import envs
from forerun.model.errors import ModelLoadError
from forerun.model.source import ModelSource

logger = logging.getLogger(__name__)

CACHE_ENV = envs.CACHE_DIR
_DISABLED = frozenset({"", "off", "0", "none", "false", "no"})
# Bump when the layout or the meaning of a stored part changes: old entries are then ignored.
# 2: a GGUF config lists the Llama 3 stop tokens (a Llama 3.0 file cached under 1 lacks them)
# and carries rope_freqs.weight as rope_scaling["freq_factors"].
CACHE_VERSION = 2
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def cache_root() -> Path | None:
    """The cache folder, or ``None`` when the user turned the cache off."""
    value = envs.cache_dir()
    if value is None:
        return Path("~/.cache/forerun").expanduser()
    if value.strip().lower() in _DISABLED:
        return None
    return Path(value).expanduser()


def file_identity(path: Path) -> tuple[str, int, int]:
    """(resolved path, size, mtime in ns): what must match for cached results to be reused."""
    resolved = path.resolve()
    st = resolved.stat()
    return str(resolved), st.st_size, st.st_mtime_ns


class GGUFCacheEntry:
    """The cache folder of one GGUF file; every read returns ``None`` on a miss or a bad part."""

    def __init__(self, folder: Path, identity: tuple[str, int, int]) -> None:
        self.folder = folder
        self.identity = identity

    @classmethod
    def for_source(cls, source: ModelSource) -> GGUFCacheEntry | None:
        """The entry for a GGUF source, or ``None`` (not GGUF, cache off, file unreadable)."""
        if not source.is_gguf:
            return None
        root = cache_root()
        if root is None:
            return None
        try:
            identity = file_identity(source.gguf_path)
        except OSError:
            return None
        digest = hashlib.sha256(
            json.dumps([CACHE_VERSION, *identity]).encode()).hexdigest()[:20]
        stem = Path(identity[0]).stem[:60]
        return cls(root / "gguf" / f"{stem}-{digest}", identity)

    # -- helpers ------------------------------------------------------------------------
    def _discard(self, part: Path, what: str, exc: BaseException) -> None:
        logger.info("ignoring unreadable cached %s at %s (%s); rebuilding it", what, part, exc)
        try:
            if part.is_dir():
                shutil.rmtree(part, ignore_errors=True)
            else:
                part.unlink(missing_ok=True)
        except OSError:
            pass

    def _prepare(self) -> bool:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            meta = self.folder / "source.json"
            if not meta.exists():
                self._write_bytes(meta, json.dumps({
                    "version": CACHE_VERSION, "path": self.identity[0],
                    "size": self.identity[1], "mtime_ns": self.identity[2],
                }, indent=1).encode())
            return True
        except OSError as exc:
            logger.info("model cache %s is not writable (%s); not caching", self.folder, exc)
            return False

    def _write_bytes(self, dest: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{dest.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    # -- config -------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.folder / "hf_config.json"

    def load_config(self) -> dict[str, Any] | None:
        """The cached ``{"config": ..., "chat_template": ...}``, or ``None``."""
        path = self.config_path
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
                raise ValueError("not a cached config")
            return data
        except (OSError, ValueError) as exc:
            self._discard(path, "config", exc)
            return None

    def discard_config(self, exc: BaseException) -> None:
        """Drop a cached config that parsed but could not be used."""
        self._discard(self.config_path, "config", exc)

    def save_config(self, config: dict[str, Any], chat_template: str | None) -> None:
        """Store the translated config and chat template; failures are logged, not raised."""
        if not self._prepare():
            return
        try:
            payload = {"config": config, "chat_template": chat_template}
            self._write_bytes(self.config_path, json.dumps(payload, indent=1).encode())
        except (OSError, TypeError, ValueError) as exc:
            logger.info("could not cache the config in %s: %s", self.folder, exc)

    # -- weights ------------------------------------------------------------------------
    def weights_path(self, dtype: torch.dtype) -> Path:
        name = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
        return self.folder / f"weights.{name}.safetensors"

    def load_weights(self, model: torch.nn.Module,
                     rename: Callable[[str], str | None] | None = None) -> bool:
        """Fill ``model``'s parameters from the cache; ``False`` (model untouched or partly
        written, to be fully overwritten by the slow path) when there is no usable entry.

        ``rename`` maps a cached (whole-model) name to the model's own, or to None for a
        tensor the model does not hold (a pipeline stage's model holds some layers only).
        """
        param = next(model.parameters())
        path = self.weights_path(param.dtype)
        if not path.is_file():
            return False
        try:
            params = dict(model.named_parameters())
            # load_file maps the file; the copy below is the only pass over the data.
            tensors = load_file(path)
            if rename is not None:
                renamed = ((rename(n), t) for n, t in tensors.items())
                tensors = {n: t for n, t in renamed if n is not None and n in params}
            if set(tensors) != set(params):
                extra, missing = set(tensors) - set(params), set(params) - set(tensors)
                raise ModelLoadError(
                    f"tensor names differ: {len(missing)} missing (e.g. "
                    f"{sorted(missing)[:3]}), {len(extra)} unexpected")
            for name, p in params.items():
                t = tensors[name]
                if t.shape != p.shape or t.dtype != p.dtype:
                    raise ModelLoadError(
                        f"{name}: cached {tuple(t.shape)} {t.dtype}, "
                        f"model {tuple(p.shape)} {p.dtype}")
            with torch.no_grad():
                for name, p in params.items():
                    p.data.copy_(tensors[name])
            return True
        except Exception as exc:  # safetensors raises its own error types on corrupt files
            self._discard(path, "weights", exc)
            return False

    def save_weights(self, model: torch.nn.Module) -> None:
        """Store ``model``'s parameters (tied ones once) in their dtype; failures are logged."""
        if not self._prepare():
            return
        param = next(model.parameters())
        dest = self.weights_path(param.dtype)
        tensors = {
            name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters()
        }
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{dest.name}.", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"forerun_cache_version": str(CACHE_VERSION)})
            os.replace(tmp, dest)
            logger.info("cached dequantised weights in %s", dest)
        except Exception as exc:
            Path(tmp).unlink(missing_ok=True)
            logger.info("could not cache the weights in %s: %s", self.folder, exc)

    # -- tokenizer ----------------------------------------------------------------------
    @property
    def tokenizer_dir(self) -> Path:
        return self.folder / "tokenizer"

    def load_tokenizer(self) -> Any | None:
        """The cached tokenizer, or ``None``."""
        folder = self.tokenizer_dir
        if not folder.is_dir():
            return None
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(folder)
        except Exception as exc:
            self._discard(folder, "tokenizer", exc)
            return None

    def save_tokenizer(self, tokenizer: Any) -> None:
        """``save_pretrained`` into a temporary folder, then rename it into place."""
        if not self._prepare():
            return
        tmp = Path(tempfile.mkdtemp(dir=self.folder, prefix=".tokenizer.", suffix=".tmp"))
        try:
            tokenizer.save_pretrained(tmp)
            try:
                os.replace(tmp, self.tokenizer_dir)
            except OSError:
                # Another process got there first (a non-empty folder cannot be replaced),
                # or a broken one is in the way: clear it and try once more.
                shutil.rmtree(self.tokenizer_dir, ignore_errors=True)
                os.replace(tmp, self.tokenizer_dir)
        except Exception as exc:
            logger.info("could not cache the tokenizer in %s: %s", self.folder, exc)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
