"""The teacher of on-policy distillation on its worker group, and its check before Ray starts.

An estimator that reads ``teacher_log_probs`` (``algorithm.adv_estimator: distill``) gets a teacher: the model at
``distill.teacher``, one frozen rank on each bundle of the round's pool beside the actor's ranks (as the reference
policy sits in the actor's), scoring each step's sampled tokens before the advantages. The student samples, the
teacher only scores, so both must read the same token ids the same way: :func:`check_teacher` refuses a teacher
whose tokenizer is not the student's, in one line, before any worker starts.
"""

from __future__ import annotations

from pathlib import Path

from rlcore.algos.advantage import ESTIMATORS
from rlcore.config import Config
from rlcore.controller.resource_pool import ResourcePool
from rlcore.controller.worker_group import WorkerGroup
from rlcore.engine.model import load_tokenizer
from rlcore.errors import ConfigError, InputNotFound
from rlcore.protocol import Batch
from rlcore.trainer.loop.model_specs import model_spec
from rlcore.workers.log_probs import LogProbSpec
from rlcore.workers.teacher import TeacherWorker


def uses_teacher(cfg: Config) -> bool:
    """The round's estimator reads a teacher's log-probs."""
    return ESTIMATORS.get(cfg.algorithm.adv_estimator).needs_teacher


def tokenizer_difference(student, teacher) -> str | None:
    """How two tokenizers differ in what the round relies on (the id of every token, the special tokens), or None."""
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        only = sorted(set(s_vocab.items()) ^ set(t_vocab.items()), key=str)[0]
        return (f"a vocabulary of {len(t_vocab)} tokens against the student's {len(s_vocab)} (first difference: "
                f"token {only[0]!r} id {only[1]})")
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            return f"{name} {getattr(teacher, name)} against the student's {getattr(student, name)}"
    return None


def check_teacher(cfg: Config, student_dir: str | Path) -> None:
    """Before Ray starts, when the estimator reads a teacher: ``distill.teacher`` is a model folder whose tokenizer is
    the student's (at ``student_dir``); otherwise a one-line error naming the key."""
    if not uses_teacher(cfg):
        return
    teacher = Path(cfg.distill.teacher)
    if not (teacher / "config.json").is_file():
        raise InputNotFound(f"distill.teacher {teacher}: no model folder there (config.json missing)")
    why = tokenizer_difference(load_tokenizer(student_dir), load_tokenizer(teacher))
    if why is not None:
        raise ConfigError(f"distill.teacher {teacher}: its tokenizer is not the student's ({student_dir}): {why}; "
                          "the teacher scores the student's token ids, so both need the same tokenizer")


def start_teacher(cfg: Config, pool: ResourcePool, *, share: int) -> WorkerGroup[TeacherWorker] | None:
    """The teacher's group on ``pool`` (``share``: groups colocated there), initialised; None when the estimator reads
    no teacher."""
    if not uses_teacher(cfg):
        return None
    group = WorkerGroup(TeacherWorker, pool, name="teacher", share=share, timeout_s=cfg.ray.timeout_s,
                        model=model_spec(cfg, cfg.distill.teacher), seed=cfg.seed)
    try:
        group.call(TeacherWorker.init_model)
    except BaseException:
        group.shutdown()
        raise
    return group


def teacher_log_probs(group: WorkerGroup[TeacherWorker], batch: Batch, cfg: Config) -> Batch:
    """``teacher_log_probs`` of ``batch``'s responses (``[rows, response_len]``), at the rollout's temperature."""
    spec = LogProbSpec(cfg.distill.micro_batch_size, cfg.rollout.temperature)
    return group.call(TeacherWorker.compute_teacher_log_prob, batch, spec)
