"""The teacher of on-policy distillation (``algorithm.adv_estimator: distill``, ``distill.teacher``), one rank: a
frozen causal LM that scores the tokens the student sampled, beside the actor's ranks as the reference is."""

from __future__ import annotations

from rlcore.controller.decorator import Dispatch, RankPlacement, register
from rlcore.engine.model import ModelSpec, load_policy
from rlcore.protocol import Batch
from rlcore.workers.log_probs import LogProbSpec, response_log_probs
from rlcore.workers.rank import RankWorker


class TeacherWorker(RankWorker):
    """A frozen teacher model; nothing trains here."""

    def __init__(self, placement: RankPlacement, *, model: ModelSpec, seed: int = 0):
        super().__init__(placement, seed)
        self.model_spec = model

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.model = load_policy(self.model_spec, self.device, frozen=True)

    @register(Dispatch.DP_COMPUTE)
    def compute_teacher_log_prob(self, batch: Batch, spec: LogProbSpec) -> Batch:
        """``teacher_log_probs`` ``[rows, response_len]``: the teacher's log-probs of each row's response tokens (at
        the rollout's temperature, as the student's are)."""
        return Batch({"teacher_log_probs": response_log_probs(self.model, batch, spec, self.device)["log_probs"]})
