"""What ``autotune train`` adds to train a user's model (launcher side): start from a Hugging Face checkpoint
(``--init-from``), tokenize ``--data`` with its tokenizer, the optimizer settings (``runner.optim.TrainSettings``)
and write the result as a Hugging Face checkpoint (``--save-hf``).

``check`` refuses, before anything is launched, what the runner cannot do with these (one line each);
``write_hf`` turns the run's last checkpoint (``torch.distributed.checkpoint``, every rank's shards) into
the full weights in this process and writes them with ``runner.hf_checkpoint.save``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from autotune.errors import SpecError
from autotune.specs import ModelSpec, ParallelConfig
from runner.optim import TrainSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FineTuning:
    init_from: Path | None = None
    save_hf: Path | None = None
    settings: TrainSettings = field(default_factory=TrainSettings)

    @classmethod
    def of(cls, init_from, save_hf, settings: TrainSettings | None) -> FineTuning:
        """From ``train``'s arguments (paths made absolute: the ranks run elsewhere)."""
        return cls(
            Path(init_from).resolve() if init_from else None,
            Path(save_hf).resolve() if save_hf else None,
            settings or TrainSettings(),
        )

    @property
    def tokenizer(self) -> Path | None:
        """The directory whose ``tokenizer.json`` tokenizes ``--data``: the checkpoint's."""
        if self.init_from is not None and (self.init_from / "tokenizer.json").is_file():
            return self.init_from
        return None

    def check(self, model: ModelSpec, config: ParallelConfig, layout, data=None) -> None:
        from runner import hf_checkpoint

        if self.init_from is not None:
            hf_checkpoint.check_directory(self.init_from)
            hf_checkpoint.check_weights(model, self.init_from)
            if data is not None and self.tokenizer is None:
                raise SpecError(
                    "--init-from",
                    "tokenizer.json",
                    f"{self.init_from} has no tokenizer.json to tokenize --data with (its bytes would be "
                    "trained on as tokens, JSON syntax and all); copy the checkpoint's tokenizer files there",
                )
        if self.save_hf is not None:
            hf_checkpoint.check_saveable(model)
            from autotune import prechecks

            prechecks.writable_dir(self.save_hf, "--save-hf")
            if config.sync_every_steps > 1:
                raise SpecError(
                    "--save-hf",
                    "",
                    "SPES plans with sync_every_steps > 1 hold a model per expert-parallel group between "
                    "synchronisations (no one model to write); use sync_every_steps 1",
                )
        if self.settings.clip_grad_norm > 0 and config.sync_every_steps > 1:
            raise SpecError(
                "--clip-grad-norm",
                "",
                "gradient clipping runs on plans without SPES's sync_every_steps > 1 (its replicas train apart "
                "between synchronisations: there is no global gradient to clip)",
            )
        if config.is_roundpipe and (self.settings != TrainSettings() or self.init_from or self.save_hf):
            raise SpecError("train", "", "RoundPipe plans train with the default settings and random weights only")

    def write_hf(self, checkpoint_dir: Path, model: ModelSpec, seed: int) -> Path | None:
        """The last checkpoint in ``checkpoint_dir`` as a Hugging Face checkpoint in ``save_hf``, and each
        earlier one not written yet in ``save_hf/checkpoint-<step>`` (Hugging Face Trainer's layout)."""
        if self.save_hf is None:
            return None
        from runner import checkpoint, hf_checkpoint

        last = checkpoint.latest(checkpoint_dir)
        if last is None:
            raise SpecError("--save-hf", "", f"no complete checkpoint in {checkpoint_dir} to write")
        for earlier in checkpoint.complete_steps(checkpoint_dir):
            out = self.save_hf / f"checkpoint-{checkpoint.step_of(earlier)}"
            if checkpoint.step_of(earlier) < checkpoint.step_of(last) and not out.exists():
                hf_checkpoint.save(checkpoint.full_weights(earlier, model, seed), model, out, self.init_from)
        weights = checkpoint.full_weights(last, model, seed)
        out = hf_checkpoint.save(weights, model, self.save_hf, self.init_from)
        log.info("Hugging Face checkpoint of step %d written to %s", checkpoint.step_of(last), out)
        return out
