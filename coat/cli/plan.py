"""A validated ``coat train`` run: what the runner, the comparison, the seeds and the export share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coat.cli.config import TrainConfig
from coat.cli.data import Corpus, HFTokenizer
from coat.cli.pretrained import InitCheckpoint


@dataclass
class RunPlan:
    """A validated run: settings, data and where it writes."""

    cfg: TrainConfig
    corpus: Corpus
    out: Path
    init: InitCheckpoint | None = None
    tokenizer: HFTokenizer | None = None
    resume: Path | None = None  # the checkpoint folder to continue from
    flags: TrainConfig | None = None  # the settings as given, before defaults: what --resume resolves again
