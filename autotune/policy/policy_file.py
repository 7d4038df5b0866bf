"""Policy files without pickle: MaskablePPO weights as raw tensors (the safetensors layout) plus JSON.

A policy file (``--policy FILE``; the shipped ``autotune/data/acquisition.safetensors``) is, byte for byte:

- 8 bytes: the length N of the header, unsigned little-endian;
- N bytes: a UTF-8 JSON object. Each tensor is ``name: {"dtype": "F32", "shape": [rows, cols],
  "data_offsets": [begin, end]}`` (byte offsets into the data after the header), and
  ``"__metadata__": {"autotune_policy": "<JSON text>"}`` describes the network: ``format``
  (``"autotune-policy"``), ``version`` (1), ``algorithm`` (``"MaskablePPO"``), ``obs_dim``,
  ``n_actions``, ``net_arch`` (hidden layer widths), ``activation`` (``"tanh"``) and the PPO
  ``hyperparameters`` used when fine-tuning;
- the tensors' raw little-endian bytes, one after the other.

Version 2 names its layout (``"acquisition"``: the chooser of ``envs.acquisition``), whose sizes it must
have. A layout or a version this autotune does not know is refused with one line (retrain with
``scripts/train_acquisition.py``); among them the files of the retired local-move walk (version 1 and layouts
``v1``, ``zero``, ``full``), which ``--method rl`` no longer runs.

That is the safetensors format, so the file also opens with the ``safetensors`` library. Reading it
never runs code: the header is parsed as JSON, the tensors are copied out with ``numpy.frombuffer``,
and the weights go into a network built here from the JSON description. Anything else (a
Stable-Baselines3 ``.zip``, whose entries are cloudpickled Python objects, a pickle, a file that
breaks a bound below) is refused with one ``SpecError`` line before any of it is interpreted.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from autotune.errors import SpecError

FORMAT = "autotune-policy"
VERSION = 2
#: versions this autotune reads
READABLE_VERSIONS = (2,)
#: layouts of the retired local-move walk (``rl`` before the chooser): named in the refusal of their files
RETIRED_LAYOUTS = ("v1", "zero", "full")
RETRAIN = "retrain with scripts/train_acquisition.py"
METADATA_KEY = "autotune_policy"
MAX_FILE_BYTES = 64 * 2**20
MAX_HEADER_BYTES = 1 * 2**20
MAX_TENSORS = 64
MAX_LAYERS = 8
MAX_WIDTH = 4096
_DTYPES = {"F32": np.dtype("<f4"), "F64": np.dtype("<f8"), "F16": np.dtype("<f2")}
ACTIVATIONS = ("tanh",)
#: PPO settings a fine-tuning run takes from the file (the rest are the constructor's defaults)
HYPERPARAMETERS = {
    "learning_rate": 1e-4,
    "gamma": 0.95,
    "gae_lambda": 0.9,
    "ent_coef": 0.01,
    "vf_coef": 0.5,
    "max_grad_norm": 0.5,
    "clip_range": 0.2,
    "n_epochs": 4,
}


def _layouts() -> dict[str, tuple[int, int]]:
    """(observations, moves) of every env a policy file may be trained on: the chooser's (``envs.acquisition``)."""
    from envs.acquisition import LAYOUT, MAX_CANDIDATES, OBSERVATIONS

    return {LAYOUT: (OBSERVATIONS, MAX_CANDIDATES)}


def _refuse(path: Path, rule: str) -> SpecError:
    return SpecError(str(path), "policy", rule)


def read(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The tensors and the network description of a policy file; ``SpecError`` for anything else."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise _refuse(path, f"file of {size} bytes is larger than the limit of {MAX_FILE_BYTES} bytes")
        blob = path.read_bytes()
    except OSError as e:
        raise _refuse(path, f"cannot read file: {e.strerror}") from None
    if blob[:4] == b"PK\x03\x04":
        raise _refuse(
            path,
            "is a zip archive (a Stable-Baselines3 save, whose entries are pickled Python objects); "
            "autotune loads only its own pickle-free policy format (README, 'Policy files')",
        )
    if blob[:1] == b"\x80":
        raise _refuse(path, "is a pickle; autotune never unpickles a file it is given (README, 'Policy files')")
    if len(blob) < 8:
        raise _refuse(path, "not an autotune policy file: too short for a header")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(blob):
        raise _refuse(
            path,
            f"not an autotune policy file: header length {n} does not fit the file (limit {MAX_HEADER_BYTES} bytes)",
        )
    try:
        header = json.loads(blob[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise _refuse(path, "not an autotune policy file: the header is not UTF-8 JSON") from None
    if not isinstance(header, dict):
        raise _refuse(path, "not an autotune policy file: the header is not a JSON object")
    meta = _metadata(path, header.pop("__metadata__", None))
    if len(header) > MAX_TENSORS:
        raise _refuse(path, f"{len(header)} tensors, more than the limit of {MAX_TENSORS}")
    data = memoryview(blob)[8 + n :]
    tensors: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        where = f"tensor {name[:60]!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise _refuse(path, f"{where}: needs exactly dtype, shape and data_offsets")
        dtype = _DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise _refuse(path, f"{where}: dtype must be one of {', '.join(_DTYPES)}")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list) and len(shape) <= 4 and all(_is_int(d) and 0 <= d <= 2**31 for d in shape)):
            raise _refuse(path, f"{where}: shape must be a list of at most 4 non-negative integers")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= len(data)
        ):
            raise _refuse(path, f"{where}: data_offsets must be [begin, end] inside the file's {len(data)} data bytes")
        count = math.prod(shape)
        if count * dtype.itemsize != offsets[1] - offsets[0]:
            raise _refuse(
                path,
                f"{where}: shape {shape} of {entry['dtype']} needs {count * dtype.itemsize} bytes, "
                f"data_offsets give {offsets[1] - offsets[0]}",
            )
        array = np.frombuffer(data[offsets[0] : offsets[1]], dtype=dtype).reshape(shape)
        if not np.isfinite(array).all():
            raise _refuse(path, f"{where}: holds NaN or infinite values")
        tensors[name] = array.astype(np.float32)
    return tensors, meta


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _metadata(path: Path, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict) or not isinstance(raw.get(METADATA_KEY), str):
        raise _refuse(path, f"not an autotune policy file: no {METADATA_KEY!r} entry in the header's __metadata__")
    try:
        meta = json.loads(raw[METADATA_KEY])
    except (json.JSONDecodeError, RecursionError):
        raise _refuse(path, f"__metadata__.{METADATA_KEY} is not JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _refuse(path, f"not an autotune policy file: format must be {FORMAT!r}")
    if meta.get("version") == 1 or meta.get("layout") in RETIRED_LAYOUTS:
        raise _refuse(
            path,
            "is a policy of the retired local-move walk, which --method rl no longer runs (rl is the chooser of "
            f"which plan to evaluate next; {RETRAIN}, or leave out --policy for the shipped one)",
        )
    if meta.get("version") not in READABLE_VERSIONS or isinstance(meta.get("version"), bool):
        raise _refuse(
            path,
            f"policy format version {str(meta.get('version'))[:20]!r}; this autotune reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))} ({RETRAIN})",
        )
    if meta.get("algorithm") != "MaskablePPO":
        raise _refuse(path, "algorithm must be 'MaskablePPO'")
    arch = meta.get("net_arch")
    if not (
        isinstance(arch, list)
        and 1 <= len(arch) <= MAX_LAYERS
        and all(_is_int(w) and 1 <= w <= MAX_WIDTH for w in arch)
    ):
        raise _refuse(path, f"net_arch must list 1 to {MAX_LAYERS} layer widths of 1 to {MAX_WIDTH}")
    if meta.get("activation") not in ACTIVATIONS:
        raise _refuse(path, f"activation must be one of {', '.join(ACTIVATIONS)}")
    layouts = _layouts()
    layout = meta.get("layout")
    if not isinstance(layout, str) or layout not in layouts:
        raise _refuse(
            path,
            f"trained on env layout {str(layout)[:40]!r}, which this autotune does not know "
            f"(it reads {', '.join(layouts)}; {RETRAIN})",
        )
    if (meta.get("obs_dim"), meta.get("n_actions")) != layouts[layout]:
        raise _refuse(
            path,
            f"layout {layout!r} has {layouts[layout][0]} observations and {layouts[layout][1]} "
            f"moves; the file says {str(meta.get('obs_dim'))[:12]} and "
            f"{str(meta.get('n_actions'))[:12]}",
        )
    hyper = meta.get("hyperparameters", {})
    if not isinstance(hyper, dict) or not all(
        k in HYPERPARAMETERS and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for k, v in hyper.items()
    ):
        raise _refuse(path, f"hyperparameters must map some of {', '.join(HYPERPARAMETERS)} to numbers")
    return meta


def write(path: str | Path, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    """Write ``tensors`` (name -> array) and ``meta`` as a policy file (safetensors layout)."""
    header: dict[str, Any] = {"__metadata__": {METADATA_KEY: json.dumps(dict(meta), sort_keys=True)}}
    chunks, offset = [], 0
    for name in sorted(tensors):
        raw = np.ascontiguousarray(np.asarray(tensors[name], dtype="<f4")).tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(np.shape(tensors[name])),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(chunks))
    tmp.replace(path)


# --------------------------------------------------------------------------------------------------
# Between files and Stable-Baselines3 models


def describe(model, **extra: Any) -> dict[str, Any]:
    """The JSON description of a MaskablePPO ``model`` (what ``write`` stores beside its weights)."""
    policy = model.policy
    import torch

    if policy.activation_fn is not torch.nn.Tanh:
        raise ValueError("only tanh policies can be written (the loader builds tanh networks)")
    arch = policy.net_arch
    if isinstance(arch, dict):
        if arch.get("pi") != arch.get("vf"):
            raise ValueError("only policies with the same policy and value layers can be written")
        arch = arch["pi"]
    clip = model.clip_range
    hyper = {
        "learning_rate": float(model.learning_rate)
        if not callable(model.learning_rate)
        else float(model.lr_schedule(1.0)),
        "gamma": float(model.gamma),
        "gae_lambda": float(model.gae_lambda),
        "ent_coef": float(model.ent_coef),
        "vf_coef": float(model.vf_coef),
        "max_grad_norm": float(model.max_grad_norm),
        "clip_range": float(clip(1.0)) if callable(clip) else float(clip),
        "n_epochs": int(model.n_epochs),
    }
    layouts = _layouts()
    sizes = (int(model.observation_space.shape[0]), int(model.action_space.n))
    layout = next((name for name, dims in layouts.items() if dims == sizes), None)
    if layout is None:
        raise ValueError(
            f"the model's {sizes[0]} observations and {sizes[1]} moves are no env layout "
            f"({', '.join(f'{k}: {v}' for k, v in layouts.items())})"
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "layout": layout,
        "algorithm": "MaskablePPO",
        "obs_dim": sizes[0],
        "n_actions": sizes[1],
        "net_arch": [int(w) for w in arch],
        "activation": "tanh",
        "hyperparameters": hyper,
        **extra,
    }


def save(model, path: str | Path, **extra: Any) -> None:
    """Write MaskablePPO ``model``'s policy network (weights only, no optimizer state) to ``path``."""
    tensors = {k: v.detach().cpu().numpy() for k, v in model.policy.state_dict().items()}
    write(path, tensors, describe(model, **extra))


def _load_weights(path: Path, policy, tensors: dict[str, np.ndarray]) -> None:
    import torch

    expected = policy.state_dict()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        which = f"lacks {missing[0]!r}" if missing else f"has an unexpected tensor {extra[0][:60]!r}"
        raise _refuse(path, f"{which} for its net_arch")
    for name, want in expected.items():
        if tuple(want.shape) != tensors[name].shape:
            raise _refuse(
                path, f"tensor {name!r} has shape {list(tensors[name].shape)}, its net_arch needs {list(want.shape)}"
            )
    policy.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in tensors.items()})


def load_policy_network(path: str | Path):
    """The chooser's network (``autotune.policy.candidate_policy.CandidatePolicy``, a
    ``MaskableActorCriticPolicy``; CPU, eval mode) with the file's weights: ``predict(obs,
    action_masks=mask, deterministic=True)`` gives the policy's choice."""
    import gymnasium as gym
    import torch

    from autotune.policy.candidate_policy import CandidatePolicy

    path = Path(path)
    tensors, meta = read(path)
    obs = gym.spaces.Box(-1.0, 1.0, shape=(meta["obs_dim"],), dtype=np.float32)
    policy = CandidatePolicy(
        obs,
        gym.spaces.Discrete(meta["n_actions"]),
        lambda _: 0.0,
        net_arch=list(meta["net_arch"]),
        activation_fn=torch.nn.Tanh,
    )
    _load_weights(path, policy, tensors)
    policy.set_training_mode(False)
    return policy


def without_log_folder(model):
    """``model`` with a logger that writes nowhere. Without one, every ``learn()`` call lets
    Stable-Baselines3 make its default logger, which creates an empty ``SB3-<date>`` folder in the
    temporary directory and never removes it (``stable_baselines3.common.logger.configure``); the
    recorded values stay readable (``model.logger.name_to_value``)."""
    from stable_baselines3.common.logger import Logger

    model.set_logger(Logger(folder=None, output_formats=[]))
    return model
