"""Independent, deliberately naive reference implementations for tests/algos.

Everything here works on plain Python floats, one sample / one token at a time, written
from the formulas of verl's ``trainer/ppo/core_algos.py`` (not from rlcore's code). Inputs
are converted to nested lists of floats; outputs are numpy float64 arrays so tests can
compare with ``numpy.testing.assert_allclose``.
"""

from __future__ import annotations

import math

import numpy as np


def to_rows(x):
    """Tensor / array -> list of lists of Python floats."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    return [[float(v) for v in row] for row in np.asarray(x, dtype=np.float64)]


def to_list(x):
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    return [float(v) for v in np.asarray(x, dtype=np.float64).reshape(-1)]


def _keys(index):
    return [k for k in (index.tolist() if hasattr(index, "tolist") else index)]


def _groups(index):
    """prompt id -> list of sample positions, in order of first appearance."""
    groups = {}
    for i, key in enumerate(_keys(index)):
        groups.setdefault(key, []).append(i)
    return groups


def _mean(xs):
    return sum(xs) / len(xs)


def _std_unbiased(xs):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _broadcast(per_sample, mask):
    return np.array([[per_sample[i] if mask[i][t] else 0.0 for t in range(len(mask[i]))] for i in range(len(mask))])


def whiten(mat, mask):
    """verl masked_whiten over all valid entries (unbiased var, +1e-8); 0 on masked."""
    vals = [mat[i][t] for i in range(len(mat)) for t in range(len(mat[i])) if mask[i][t]]
    n = len(vals)
    mu = sum(vals) / n
    var = sum((v - mu) ** 2 for v in vals) / n * n / (n - 1)
    inv = 1.0 / math.sqrt(var + 1e-8)
    return np.array(
        [[(mat[i][t] - mu) * inv if mask[i][t] else 0.0 for t in range(len(mat[i]))] for i in range(len(mat))]
    )


# ------------------------------------------------------------------ estimators


def gae(rewards, values, mask, gamma, lam):
    """GAE on the subsequence of valid tokens of each row (masked tokens are skipped)."""
    r, v, m = to_rows(rewards), to_rows(values), to_rows(mask)
    adv = [[0.0] * len(row) for row in r]
    for i in range(len(r)):
        valid = [t for t in range(len(r[i])) if m[i][t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(valid):
            delta = r[i][t] + gamma * next_value - v[i][t]
            adv[i][t] = delta + gamma * lam * next_adv
            next_value, next_adv = v[i][t], adv[i][t]
    returns = np.array([[adv[i][t] + v[i][t] if m[i][t] else 0.0 for t in range(len(r[i]))] for i in range(len(r))])
    return whiten(adv, m), returns


def grpo(rewards, mask, index, norm_by_std=True, eps=1e-6):
    r, m = to_rows(rewards), to_rows(mask)
    scores = [sum(row) for row in r]
    out = [0.0] * len(scores)
    for members in _groups(index).values():
        group = [scores[i] for i in members]
        mu, sd = (0.0, 1.0) if len(group) == 1 else (_mean(group), _std_unbiased(group))
        for i in members:
            out[i] = (scores[i] - mu) / (sd + eps) if norm_by_std else scores[i] - mu
    a = _broadcast(out, m)
    return a, a


def distill(rewards, mask, index, student, teacher, reward_weight=0.0, norm_by_std=True, eps=1e-6):
    """Each valid token's advantage: the teacher's log-prob of it minus the student's, plus the reward's GRPO advantage
    times ``reward_weight``."""
    m, s, t = to_rows(mask), to_rows(student), to_rows(teacher)
    outcome, _ = grpo(rewards, mask, index, norm_by_std, eps)
    a = [[(t[i][j] - s[i][j] + reward_weight * outcome[i][j]) if m[i][j] else 0.0 for j in range(len(m[i]))]
         for i in range(len(m))]
    return a, a


def grpo_passk(rewards, mask, index, norm_by_std=True, eps=1e-6):
    r, m = to_rows(rewards), to_rows(mask)
    scores = [sum(row) for row in r]
    out = [0.0] * len(scores)
    for members in _groups(index).values():
        group = [scores[i] for i in members]
        ordered = sorted(group, reverse=True)
        gap = ordered[0] - ordered[1]
        if norm_by_std:
            gap = gap / (_std_unbiased(group) + eps)
        best = members[group.index(ordered[0])]
        out[best] = gap
    a = _broadcast(out, m)
    return a, a


def rloo(rewards, mask, index):
    r, m = to_rows(rewards), to_rows(mask)
    scores = [sum(row) for row in r]
    out = list(scores)
    for members in _groups(index).values():
        if len(members) > 1:
            for i in members:
                others = [scores[j] for j in members if j != i]
                out[i] = scores[i] - _mean(others)
    a = _broadcast(out, m)
    return a, a


def opo(rewards, mask, index):
    r, m = to_rows(rewards), to_rows(mask)
    scores = [sum(row) for row in r]
    lengths = [sum(row) for row in m]
    out = [0.0] * len(scores)
    for members in _groups(index).values():
        if len(members) == 1:
            baseline = 0.0
        else:
            baseline = sum(lengths[j] * scores[j] for j in members) / sum(lengths[j] for j in members)
        for i in members:
            out[i] = scores[i] - baseline
    a = _broadcast(out, m)
    return a, a


def gpg(rewards, mask, index, f_norm=1.0):
    r, m = to_rows(rewards), to_rows(mask)
    scores = [sum(row) for row in r]
    nonzero = sum(1 for s in scores if s != 0)
    alpha = len(scores) / max(nonzero, 1)
    out = [0.0] * len(scores)
    for members in _groups(index).values():
        mu = 0.0 if len(members) == 1 else _mean([scores[j] for j in members])
        for i in members:
            out[i] = alpha * (scores[i] - mu) / f_norm
    a = _broadcast(out, m)
    return a, a


def reinforce_plus_plus(rewards, mask, gamma):
    """On the subsequence of valid tokens of each row (masked tokens skipped, their rewards dropped):
    G_k = sum_{j >= k} gamma^(j - k) r_j, k and j counting valid tokens only."""
    r, m = to_rows(rewards), to_rows(mask)
    returns = [[0.0] * len(row) for row in r]
    for i in range(len(r)):
        valid = [t for t in range(len(r[i])) if m[i][t]]
        for k, t in enumerate(valid):
            returns[i][t] = sum(gamma ** (j - k) * r[i][u] for j, u in enumerate(valid) if j >= k)
    return whiten(returns, m), np.array(returns)


def reinforce_plus_plus_baseline(rewards, mask, index):
    r, m = to_rows(rewards), to_rows(mask)
    scores = [sum(row) for row in r]
    centred = [0.0] * len(scores)
    for members in _groups(index).values():
        mu = 0.0 if len(members) == 1 else _mean([scores[j] for j in members])
        for i in members:
            centred[i] = scores[i] - mu
    a = whiten(_broadcast(centred, m).tolist(), m)
    return a, a


def remax(rewards, mask, baselines):
    r, m, b = to_rows(rewards), to_rows(mask), to_list(baselines)
    returns, adv = [], []
    for i in range(len(r)):
        T = len(r[i])
        g = [sum(r[i][u] for u in range(t, T) if m[i][u]) if m[i][t] else 0.0 for t in range(T)]
        returns.append(g)
        adv.append([g[t] - b[i] if m[i][t] else 0.0 for t in range(T)])
    return np.array(adv), np.array(returns)


def gdpo(components, mask, index, weights=None, norm_by_std=True, eps=1e-6, batch_norm=True):
    """Each component normalised in its group as GRPO does, weighted sum, then whitened over valid tokens."""
    c, m = to_rows(components), to_rows(mask)
    n = len(c[0])
    weights = weights or [1.0] * n
    total = [0.0] * len(c)
    for k in range(n):
        column = [[c[i][k]] for i in range(len(c))]
        a, _ = grpo(column, [[1.0]] * len(c), index, norm_by_std, eps)
        for i in range(len(c)):
            total[i] += weights[k] * a[i][0]
    adv = _broadcast(total, m)
    if batch_norm:
        adv = whiten(adv.tolist(), m)
    return adv, adv


def _otb(rewards, mask, index, old_logp, sum_pi_sq, zero_tail, compact):
    """Optimal token baseline on per-row token lists: absolute positions, or (``compact``) the valid tokens
    of each row in order, rows without one leaving their group."""
    r, m, lp, s2 = to_rows(rewards), to_rows(mask), to_rows(old_logp), to_rows(sum_pi_sq)
    B, T = len(r), len(r[0])
    G = [[sum(r[i][u] for u in range(t, T) if m[i][u]) for t in range(T)] for i in range(B)]
    W = []
    for i in range(B):
        acc, row = 0.0, []
        for t in range(T):
            if m[i][t]:
                acc += 1.0 - 2.0 * math.exp(lp[i][t]) + s2[i][t]
            row.append(acc)
        W.append(row)
    # each row as the list of (position, valid) it is aligned on
    slots = [[t for t in range(T) if m[i][t]] if compact else list(range(T)) for i in range(B)]
    valid = [[1.0] * len(slots[i]) if compact else [m[i][t] for t in range(T)] for i in range(B)]
    adv = [[0.0] * T for _ in range(B)]
    groups = {}
    for i, key in enumerate(_keys(index)):
        if not compact or slots[i]:
            groups.setdefault(key, []).append(i)
    for members in groups.values():
        lengths = {i: sum(valid[i]) for i in members}
        width = max(len(slots[i]) for i in members)
        base = [0.0] * width
        if len(members) > 1:
            for k in range(width):
                num = sum(G[i][slots[i][k]] * W[i][slots[i][k]] * valid[i][k] for i in members if k < len(slots[i]))
                den = sum(W[i][slots[i][k]] * valid[i][k] for i in members if k < len(slots[i]))
                base[k] = num / (den + 1e-8)
        ordered = sorted(lengths.values())
        for i in members:
            own = list(base)
            if zero_tail and len(members) > 1 and ordered[-1] > ordered[-2] and lengths[i] == ordered[-1]:
                for k in range(int(ordered[-2]), width):
                    own[k] = 0.0
            for k, t in enumerate(slots[i]):
                if m[i][t]:
                    adv[i][t] = G[i][t] - own[k]
    returns = [[G[i][t] if m[i][t] else 0.0 for t in range(T)] for i in range(B)]
    return np.array(adv), np.array(returns)


def optimal_token_baseline(rewards, mask, index, old_logp, sum_pi_sq, zero_tail=True):
    return _otb(rewards, mask, index, old_logp, sum_pi_sq, zero_tail, compact=False)


def tir_optimal_token_baseline(rewards, mask, index, old_logp, sum_pi_sq, zero_tail=True):
    return _otb(rewards, mask, index, old_logp, sum_pi_sq, zero_tail, compact=True)


# ------------------------------------------------------------------ KL, aggregation


def kl(logp, ref, kind):
    """Values only; a ``+`` kind has the value of its base kind (its gradient is k2's)."""
    kind = kind.rstrip("+")
    out = []
    for row_p, row_r in zip(to_rows(logp), to_rows(ref)):
        new_row = []
        for p, q in zip(row_p, row_r):
            d = p - q
            if kind in ("kl", "k1"):
                new_row.append(d)
            elif kind == "abs":
                new_row.append(abs(d))
            elif kind in ("mse", "k2"):
                new_row.append(0.5 * d * d)
            else:
                x = min(max(q - p, -20.0), 20.0)
                new_row.append(min(max(math.exp(x) - x - 1.0, -10.0), 10.0))
        out.append(new_row)
    return np.array(out)


def agg(loss_mat, mask, mode, loss_scale_factor=None):
    """verl's current definitions: the sequence modes average over rows with a valid token;
    seq-mean-token-sum-norm is seq-mean-token-sum divided by a constant (default: the row width)."""
    l, m = to_rows(loss_mat), to_rows(mask)
    total = sum(l[i][t] for i in range(len(l)) for t in range(len(l[i])) if m[i][t])
    if mode in ("token-mean", "bnpo"):
        return total / sum(sum(row) for row in m)
    if mode == "token-sum":
        return total
    per_seq = []
    for i in range(len(l)):
        n = sum(m[i])
        if n == 0:
            continue  # fully masked rows are excluded from sequence means
        s = sum(l[i][t] for t in range(len(l[i])) if m[i][t])
        per_seq.append(s / n if mode == "seq-mean-token-mean" else s)
    mean = sum(per_seq) / len(per_seq)
    if mode == "seq-mean-token-sum-norm":
        return mean / (len(m[0]) if loss_scale_factor is None else loss_scale_factor)
    return mean


def _masked_mean(mat, m):
    vals = [mat[i][t] for i in range(len(m)) for t in range(len(m[i])) if m[i][t]]
    return sum(vals) / len(vals)


# ------------------------------------------------------------------ policy losses


def vanilla(old, logp, adv, mask, mode, low, high, c, lsf=None):
    o, p, a, m = to_rows(old), to_rows(logp), to_rows(adv), to_rows(mask)
    losses, clip_hi, clip_lo, neg_kl = [], [], [], []
    for i in range(len(p)):
        rows = ([], [], [], [])
        for t in range(len(p[i])):
            d = min(max(p[i][t] - o[i][t], -20.0), 20.0)
            ratio = math.exp(d)
            l1 = -a[i][t] * ratio
            l2 = -a[i][t] * min(max(ratio, 1 - low), 1 + high)
            c1 = max(l1, l2)
            l3 = -a[i][t] * c
            rows[0].append(min(c1, l3) if a[i][t] < 0 else c1)
            rows[1].append(1.0 if l2 > l1 else 0.0)
            rows[2].append(1.0 if (c1 > l3 and a[i][t] < 0) else 0.0)
            rows[3].append(-d)
        for acc, row in zip((losses, clip_hi, clip_lo, neg_kl), rows):
            acc.append(row)
    metrics = {"pg_clipfrac": _masked_mean(clip_hi, m), "pg_clipfrac_lower": _masked_mean(clip_lo, m),
               "ppo_kl": _masked_mean(neg_kl, m)}
    return agg(losses, m, mode, lsf), metrics


def gspo(old, logp, adv, mask, low, high):
    """Aggregated as a mean over sequences of per-sequence token means, whatever the configured mode."""
    o, p, a, m = to_rows(old), to_rows(logp), to_rows(adv), to_rows(mask)
    losses, clipped = [], []
    for i in range(len(p)):
        valid = [t for t in range(len(p[i])) if m[i][t]]
        log_s = sum(p[i][t] - o[i][t] for t in valid) / max(len(valid), 1)
        s = math.exp(min(log_s, 10.0))
        s_clip = min(max(s, 1 - low), 1 + high)
        losses.append([max(-a[i][t] * s, -a[i][t] * s_clip) for t in range(len(p[i]))])
        clipped.append([1.0 if -a[i][t] * s_clip > -a[i][t] * s else 0.0 for t in range(len(p[i]))])
    kl_rows = [[o[i][t] - p[i][t] for t in range(len(p[i]))] for i in range(len(p))]
    metrics = {"pg_clipfrac": _masked_mean(clipped, m), "pg_clipfrac_lower": 0.0, "ppo_kl": _masked_mean(kl_rows, m)}
    return agg(losses, m, "seq-mean-token-mean"), metrics


def geo_mean(old, logp, adv, mask, low, high):
    o, p, a, m = to_rows(old), to_rows(logp), to_rows(adv), to_rows(mask)
    seq_losses, hi, lo = [], [], []
    for i in range(len(p)):
        log_sum, adv_sum, n = 0.0, 0.0, 0.0
        hi_row, lo_row = [], []
        for t in range(len(p[i])):
            d = p[i][t] - o[i][t]
            d_clamped = min(max(d, -low), high)
            if a[i][t] > 0:
                d_used = min(d, d_clamped)
            elif a[i][t] < 0:
                d_used = max(d, d_clamped)
            else:
                d_used = 0.0
            hi_row.append(1.0 if (d != d_clamped and a[i][t] > 0) else 0.0)
            lo_row.append(1.0 if (d != d_clamped and a[i][t] < 0) else 0.0)
            if m[i][t]:
                log_sum += d_used
                adv_sum += a[i][t]
                n += 1
        seq_losses.append(-(adv_sum / (n + 1e-8)) * math.exp(log_sum / (n + 1e-8)))
        hi.append(hi_row)
        lo.append(lo_row)
    kl_rows = [[o[i][t] - p[i][t] for t in range(len(p[i]))] for i in range(len(p))]
    metrics = {"pg_clipfrac": _masked_mean(hi, m), "pg_clipfrac_lower": _masked_mean(lo, m),
               "ppo_kl": _masked_mean(kl_rows, m)}
    return sum(seq_losses) / len(seq_losses), metrics


def gpg_loss(logp, adv, mask, mode, lsf=None):
    p, a = to_rows(logp), to_rows(adv)
    losses = [[-p[i][t] * a[i][t] for t in range(len(p[i]))] for i in range(len(p))]
    return agg(losses, mask, mode, lsf), {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": 0.0}


def cispo(old, logp, adv, mask, mode, low, high, lsf=None):
    o, p, a, m = to_rows(old), to_rows(logp), to_rows(adv), to_rows(mask)
    losses, clipped, kl_rows = [], [], []
    for i in range(len(p)):
        l_row, c_row, k_row = [], [], []
        for t in range(len(p[i])):
            d = min(max(p[i][t] - o[i][t], -20.0), 20.0)
            ratio = math.exp(d)
            w = min(max(ratio, 1 - low), 1 + high)
            l_row.append(-w * a[i][t] * p[i][t])
            c_row.append(1.0 if w != ratio else 0.0)
            k_row.append(-d)
        losses.append(l_row)
        clipped.append(c_row)
        kl_rows.append(k_row)
    metrics = {"pg_clipfrac": _masked_mean(clipped, m), "pg_clipfrac_lower": 0.0, "ppo_kl": _masked_mean(kl_rows, m)}
    return agg(losses, m, mode, lsf), metrics


def _covariances(adv, logp, m):
    """(A - mean A)(logp - mean logp) per token, means over the valid tokens."""
    mean_a, mean_p = _masked_mean(adv, m), _masked_mean(logp, m)
    return [[(adv[i][t] - mean_a) * (logp[i][t] - mean_p) for t in range(len(m[i]))] for i in range(len(m))]


def _top_k(candidates, key, k):
    """The k candidates (row-major (i, t) pairs) with the largest key; ties broken by position."""
    return set(sorted(candidates, key=lambda it: (-key[it[0]][it[1]], it))[:k])


def clip_cov(old, logp, adv, mask, mode, low, high, ratio, lb, ub, lsf=None):
    """PPO clip, with the loss of the k = max(int(ratio * #valid), 1) highest-covariance candidates
    (valid, not clipped by PPO, lb < cov < ub) set to 0 (k capped at the number of candidates)."""
    o, p, a, m = to_rows(old), to_rows(logp), to_rows(adv), to_rows(mask)
    cov = _covariances(a, p, m)
    losses, candidates = [], []
    n_valid = sum(1 for row in m for v in row if v)
    for i in range(len(p)):
        row = []
        for t in range(len(p[i])):
            ratio_it = math.exp(p[i][t] - o[i][t])
            l1, l2 = -a[i][t] * ratio_it, -a[i][t] * min(max(ratio_it, 1 - low), 1 + high)
            row.append(max(l1, l2))
            if m[i][t] and not l2 > l1 and lb < cov[i][t] < ub:
                candidates.append((i, t))
        losses.append(row)
    chosen = _top_k(candidates, cov, min(max(int(ratio * n_valid), 1), len(candidates)))
    for i, t in chosen:
        losses[i][t] = 0.0
    cut = [[1.0 if (i, t) in chosen else 0.0 for t in range(len(m[i]))] for i in range(len(m))]
    kl_rows = [[o[i][t] - p[i][t] for t in range(len(p[i]))] for i in range(len(p))]
    metrics = {"pg_clipfrac": _masked_mean(cut, m), "pg_clipfrac_lower": 0.0, "ppo_kl": _masked_mean(kl_rows, m)}
    return agg(losses, m, mode, lsf), metrics


def kl_cov(old, logp, adv, mask, mode, ratio, coef, lsf=None):
    """Unclipped -A r, plus coef * |logp - logp_old| on the k = max(int(#valid * ratio), 1) valid
    tokens with the largest covariance."""
    o, p, a, m = to_rows(old), to_rows(logp), to_rows(adv), to_rows(mask)
    cov = _covariances(a, p, m)
    valid = [(i, t) for i in range(len(m)) for t in range(len(m[i])) if m[i][t]]
    chosen = _top_k(valid, cov, max(1, int(len(valid) * ratio)))
    losses = [[-a[i][t] * math.exp(p[i][t] - o[i][t]) + (coef * abs(p[i][t] - o[i][t]) if (i, t) in chosen else 0.0)
               for t in range(len(p[i]))] for i in range(len(p))]
    abs_kl = [[abs(p[i][t] - o[i][t]) for t in range(len(p[i]))] for i in range(len(p))]
    metrics = {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": _masked_mean(abs_kl, m)}
    return agg(losses, m, mode, lsf), metrics


def dppo(old, logp, adv, mask, mode, low, high, c, divergence, lsf=None):
    """DPPO: -A min(r, c) logp on the tokens inside the binary TV or KL trust region, 0 elsewhere."""
    o, p, a, m = to_rows(old), to_rows(logp), to_rows(adv), to_rows(mask)
    losses, outside, truncated, neg_kl = [], [], [], []
    for i in range(len(p)):
        l_row, out_row, tr_row, k_row = [], [], [], []
        for t in range(len(p[i])):
            d = min(max(p[i][t] - o[i][t], -20.0), 20.0)
            ratio = math.exp(d)
            q, q_old = math.exp(p[i][t]), math.exp(o[i][t])
            if divergence == "tv":
                ok = (q - q_old <= high) if a[i][t] > 0 else (q - q_old >= -low)
            else:
                bkl = q_old * (o[i][t] - p[i][t]) + (1 - q_old) * math.log((1 - q_old + 1e-8) / (1 - q + 1e-8))
                ok = (bkl <= high or q <= q_old) if a[i][t] > 0 else (bkl <= low or q >= q_old)
            l_row.append(-a[i][t] * min(ratio, c) * p[i][t] if ok else 0.0)
            out_row.append(0.0 if ok else 1.0)
            tr_row.append(1.0 if (ok and ratio > c) else 0.0)
            k_row.append(-d)
        for acc, row in zip((losses, outside, truncated, neg_kl), (l_row, out_row, tr_row, k_row)):
            acc.append(row)
    metrics = {"pg_clipfrac": _masked_mean(outside, m), "pg_clipfrac_lower": _masked_mean(truncated, m),
               "ppo_kl": _masked_mean(neg_kl, m)}
    return agg(losses, m, mode, lsf), metrics


def sapo(old, logp, adv, mask, tau_pos, tau_neg):
    o, p, a, m = to_rows(old), to_rows(logp), to_rows(adv), to_rows(mask)
    losses = []
    for i in range(len(p)):
        row = []
        for t in range(len(p[i])):
            ratio = math.exp(min(max(p[i][t] - o[i][t], -20.0), 20.0))
            tau = tau_pos if a[i][t] > 0 else tau_neg
            gate = 4.0 / tau / (1.0 + math.exp(-tau * (ratio - 1.0)))
            row.append(-gate * a[i][t])
        losses.append(row)
    return agg(losses, m, "seq-mean-token-mean")


def dro(old, logp, adv, mask, mode, beta, lsf=None):
    o, p, a = to_rows(old), to_rows(logp), to_rows(adv)
    losses = [[-(p[i][t] * a[i][t] - 0.5 * beta * (p[i][t] - o[i][t]) ** 2) for t in range(len(p[i]))]
              for i in range(len(p))]
    return agg(losses, mask, mode, lsf)


def luspo(old, logp, adv, mask, low, high):
    """(1/B) sum over rows of L_i * max(-A s_i, -A clip(s_i)), s_i the geometric mean token ratio; with
    per-token advantages, the sum over the row's valid tokens."""
    o, p, a, m = to_rows(old), to_rows(logp), to_rows(adv), to_rows(mask)
    total = 0.0
    for i in range(len(p)):
        valid = [t for t in range(len(p[i])) if m[i][t]]
        s = math.exp(min(sum(p[i][t] - o[i][t] for t in valid) / max(len(valid), 1), 10.0))
        sc = min(max(s, 1 - low), 1 + high)
        total += sum(max(-a[i][t] * s, -a[i][t] * sc) for t in valid)
    return total / len(p)


def vespo(old, logp, adv, mask, mode, k_pos, lam_pos, k_neg, lam_neg, lsf=None):
    o, p, a, m = to_rows(old), to_rows(logp), to_rows(adv), to_rows(mask)
    losses = []
    for i in range(len(p)):
        log_w = sum(min(max(p[i][t] - o[i][t], -20.0), 20.0) for t in range(len(p[i])) if m[i][t])
        log_w = min(max(log_w, math.log(1e-8)), 20.0)
        row = []
        for t in range(len(p[i])):
            k, lam = (k_pos, lam_pos) if a[i][t] >= 0 else (k_neg, lam_neg)
            lam = max(lam, 1e-4)
            phi = math.exp(lam) * math.exp(log_w) ** k * math.exp(-lam * math.exp(log_w))
            row.append(-phi * a[i][t] * p[i][t])
        losses.append(row)
    return agg(losses, m, mode, lsf)


def _divergence(kind, d):
    return {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - 1.0 - d}[kind]


def bypass(old, logp, adv, mask, mode, loss_type, is_level, is_upper, is_lower, rs, rs_upper, rs_lower,
           low, high, c, lsf=None):
    """IS weights and rejection between logp and the rollout's old log-probs, token by token."""
    o, p, a, m = to_rows(old), to_rows(logp), to_rows(adv), to_rows(mask)
    B, T = len(p), len(p[0])
    d = [[min(max(p[i][t] - o[i][t], -20.0), 20.0) for t in range(T)] for i in range(B)]
    weights, keep = [], []
    for i in range(B):
        valid = [t for t in range(T) if m[i][t]]
        seq = min(max(sum(p[i][t] - o[i][t] for t in valid), -20.0), 20.0)
        w_row, k_row = [], []
        for t in range(T):
            raw = {"token": math.exp(d[i][t]), "sequence": math.exp(seq), "none": 1.0}[is_level] if m[i][t] else 0.0
            if is_level != "none":
                raw = min(raw, is_upper) if is_lower is None else (raw if is_lower <= raw <= is_upper else 0.0)
            w_row.append(raw)
            if rs is None:
                k_row.append(1.0)
                continue
            level, kind = rs.rsplit("_", 1)
            stats = [_divergence(kind, d[i][u]) for u in valid]
            stat = {"token": _divergence(kind, d[i][t]), "seq_sum": sum(stats),
                    "seq_mean": sum(stats) / max(len(stats), 1), "seq_max": max(stats) if stats else 0.0}[level]
            if kind == "k1":
                lo = 1.0 / rs_upper if rs_lower is None else rs_lower
                ok = math.log(lo) <= stat <= math.log(rs_upper)
            else:
                ok = stat <= rs_upper
            k_row.append(1.0 if ok else 0.0)
        weights.append(w_row)
        keep.append(k_row)
    masked_adv = [[a[i][t] * keep[i][t] for t in range(T)] for i in range(B)]
    if loss_type == "reinforce":
        losses = [[-masked_adv[i][t] * weights[i][t] * p[i][t] for t in range(T)] for i in range(B)]
        loss = agg(losses, m, mode, lsf)
    else:
        loss, _ = vanilla(old, logp, masked_adv, mask, mode, low, high, c, lsf)
    return loss, {"is_weight_mean": _masked_mean(weights, m), "rejected_frac": _masked_mean(
        [[1.0 - v for v in row] for row in keep], m)}


def value_loss(vpreds, returns, values, mask, clip):
    """0.5 * token-mean of max((v - R)^2, (clip(v, V_old +- c) - R)^2), and the clipped fraction."""
    v, r, old, m = to_rows(vpreds), to_rows(returns), to_rows(values), to_rows(mask)
    losses, clipped = [], []
    for i in range(len(v)):
        l_row, c_row = [], []
        for t in range(len(v[i])):
            vc = min(max(v[i][t], old[i][t] - clip), old[i][t] + clip)
            unclipped, clipped_sq = (v[i][t] - r[i][t]) ** 2, (vc - r[i][t]) ** 2
            l_row.append(max(unclipped, clipped_sq))
            c_row.append(1.0 if clipped_sq > unclipped else 0.0)
        losses.append(l_row)
        clipped.append(c_row)
    return 0.5 * agg(losses, m, "token-mean"), _masked_mean(clipped, m)


# ------------------------------------------------------------------ random inputs


def random_batch(seed, group_sizes=(3, 2, 1, 4), response_len=7, dtype=None, holes=False):
    """Right-padded random batch: rewards, mask, values, index, lengths (float64 torch).

    Lengths differ per row (1..response_len); padding positions hold random junk so a
    leak from padding would show up in comparisons. With ``holes``, about a quarter of the
    positions inside each response (never its first) are masked too, like observation tokens.
    """
    import torch

    dtype = dtype or torch.float64
    gen = torch.Generator().manual_seed(seed)
    batch = sum(group_sizes)
    lengths = torch.randint(1, response_len + 1, (batch,), generator=gen)
    lengths[0] = response_len  # at least one full-length row
    positions = torch.arange(response_len).unsqueeze(0)
    mask = (positions < lengths.unsqueeze(1)).to(dtype)
    if holes:
        hole = torch.rand(batch, response_len, generator=gen) < 0.25
        hole[:, 0] = False
        mask = mask.masked_fill(hole, 0.0)
    rewards = torch.randn(batch, response_len, generator=gen, dtype=dtype)
    values = torch.randn(batch, response_len, generator=gen, dtype=dtype)
    index = np.array([f"prompt-{g}" for g, size in enumerate(group_sizes) for _ in range(size)], dtype=object)
    return rewards, mask, values, index, lengths
