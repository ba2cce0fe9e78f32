"""Independent float64 numpy implementations of the loss formulas (docs/losses.md).

Written from the formulas, not from the package: loops over tokens where that reads
closer to the math. Shape letters: B batch, T tokens, V vocab, K teachers, G group.
"""
from __future__ import annotations

import numpy as np


def log_softmax(x, tau=1.0):
    x = np.asarray(x, np.float64) / tau
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def token_logprobs(logits_BxTxV, y_BxT, tau=1.0):
    lp = log_softmax(logits_BxTxV, tau)
    b, t = y_BxT.shape
    return np.array([[lp[i, j, y_BxT[i, j]] for j in range(t)] for i in range(b)])


def entropy(logits, tau=1.0):
    lp = log_softmax(logits, tau)
    return -(np.exp(lp) * lp).sum(-1)


def aggregate(l_BxT, m_BxT, mode="token_mean", max_len=None, denom_BxT=None):
    l_BxT, m_BxT = np.asarray(l_BxT, np.float64), np.asarray(m_BxT, np.float64)
    d_BxT = m_BxT if denom_BxT is None else np.asarray(denom_BxT, np.float64)
    b, t = l_BxT.shape
    num = np.where(m_BxT != 0, l_BxT * m_BxT, 0.0)
    if mode == "token_mean":
        return num.sum() / d_BxT.sum() if d_BxT.sum() > 0 else 0.0
    if mode == "seq_mean":
        rows = [num[i].sum() / d_BxT[i].sum() for i in range(b) if d_BxT[i].sum() > 0]
        return float(np.mean(rows)) if rows else 0.0
    return num.sum() / (b * (t if max_len is None else max_len))


def masked_mean(x, m):
    m = np.asarray(m, np.float64)
    return float((np.where(m != 0, x, 0) * m).sum() / m.sum())


def group_advantages(r_BxG, scale="std", eps=1e-6, ddof=1):
    r = np.asarray(r_BxG, np.float64)
    out = np.zeros_like(r)
    for i, row in enumerate(r):
        mean = row.sum() / len(row)
        if scale == "none":
            out[i] = row - mean
        else:
            std = np.sqrt(((row - mean) ** 2).sum() / (len(row) - ddof))
            out[i] = (row - mean) / (std + eps)
    return out


def ppo_token(lp, old, a, eps_low, eps_high, dual_clip=None):
    """Per-token PPO-clip loss, scalar by scalar."""
    rho = np.exp(lp - old)
    l = -min(rho * a, min(max(rho, 1 - eps_low), 1 + eps_high) * a)
    if dual_clip is not None and a < 0:
        l = min(l, -dual_clip * a)
    return l


def correction_weight(old, sampler, kind, bounds=(0.5, 5.0), cap=2.0):
    if kind is None:
        return 1.0
    k = np.exp(old - sampler)
    if kind == "icepop":
        return 1.0 if bounds[0] <= k <= bounds[1] else 0.0
    return min(k, cap)


def position_weight(m, gamma):
    """IW-OPD: 1 + gamma (1 - share of the row's loss tokens before t), token by token."""
    b, t = m.shape
    w = np.ones((b, t))
    for i in range(b):
        n, seen = sum(1 for j in range(t) if m[i, j] != 0), 0
        for j in range(t):
            if m[i, j] != 0:
                w[i, j] = 1.0 + gamma * (1.0 - seen / n)
                seen += 1
    return w


def grpo(lp, old, adv, m, *, eps_low=0.2, eps_high=0.2, dual_clip=None, ref=None, beta=0.0,
         sampler=None, correction=None, bounds=(0.5, 5.0), normalizer="all", cap=2.0,
         mode="token_mean", max_len=None, gamma=0.0):
    b, t = lp.shape
    adv = np.broadcast_to(adv if adv.ndim == 2 else adv[:, None], (b, t))
    pg = np.zeros((b, t))
    w = np.ones((b, t))
    for i in range(b):
        for j in range(t):
            if m[i, j] == 0:
                continue
            pg[i, j] = ppo_token(lp[i, j], old[i, j], adv[i, j], eps_low, eps_high, dual_clip)
            if sampler is not None:
                w[i, j] = correction_weight(old[i, j], sampler[i, j], correction, bounds, cap)
    denom = m * w if (correction == "icepop" and normalizer == "kept") else m
    loss = aggregate(pg * w * position_weight(m, gamma), m, mode, max_len, denom)
    if ref is not None:
        d = np.where(m != 0, ref - lp, 0.0)
        loss += beta * aggregate(np.exp(d) - d - 1, m, mode, max_len)
    return loss


def kimi(lp, teacher, m, r_max, *, old=None, eps_low=0.2, eps_high=0.2, sampler=None,
         correction=None, bounds=(0.5, 5.0), normalizer="all", cap=2.0, mode="token_mean",
         gamma=0.0):
    base = lp if old is None else old
    r = np.clip(teacher - base, -r_max, r_max)
    b, t = lp.shape
    l = np.zeros((b, t))
    w = np.ones((b, t))
    for i in range(b):
        for j in range(t):
            if m[i, j] == 0:
                continue
            if old is None:
                l[i, j] = -r[i, j] * lp[i, j]
            else:
                l[i, j] = ppo_token(lp[i, j], old[i, j], r[i, j], eps_low, eps_high)
            if sampler is not None:
                w[i, j] = correction_weight(base[i, j], sampler[i, j], correction, bounds, cap)
    denom = m * w if (correction == "icepop" and normalizer == "kept") else m
    return aggregate(l * w * position_weight(m, gamma), m, mode, None, denom)


def glm(lp, old, teacher, m, *, eps_low=0.2, eps_high=0.2, task_adv=None, kl_coef=1.0,
        mode="token_mean", gamma=0.0):
    adv = -kl_coef * (old - teacher)
    if task_adv is not None:
        adv = adv + (task_adv if task_adv.ndim == 2 else task_adv[:, None])
    return grpo(lp, old, adv, m, eps_low=eps_low, eps_high=eps_high, mode=mode, gamma=gamma)


def kl(p, q):
    """sum_v p_v log(p_v / q_v) for probability vectors (last axis)."""
    return (p * (np.log(p) - np.log(q))).sum(-1)


def divergence(kind, s_BxTxV, t_logits, m, weights=None, tau=1.0, beta=0.5):
    p = np.exp(log_softmax(s_BxTxV, tau))
    stacked = np.ndim(t_logits) == 4
    qs = np.exp(log_softmax(t_logits, tau)) if stacked else np.exp(log_softmax(t_logits, tau))[None]
    k, b = qs.shape[0], p.shape[0]
    t = p.shape[1]
    if weights is None:
        w = np.full((b, t, k), 1.0 / k)
    elif np.ndim(weights) == 3:                 # per token [B, T, K]
        w = np.asarray(weights, np.float64)
    else:
        w = np.broadcast_to(weights, (b, k)) if np.ndim(weights) == 1 else np.asarray(weights)
        w = np.broadcast_to(np.asarray(w, np.float64)[:, None, :], (b, t, k))
    per = np.zeros(p.shape[:2])
    for kk in range(k):
        q = qs[kk]
        if kind == "reverse":
            d = kl(p, q)
        elif kind == "forward":
            d = kl(q, p)
        else:
            mix = beta * p + (1 - beta) * q
            d = beta * kl(p, mix) + (1 - beta) * kl(q, mix)
        per += w[:, :, kk] * d
    return aggregate(per, m)


def topk_divergence(kind, s_BxTxV, ids_BxTxK, lq_BxTxK, m, tau=1.0, mode="token_mean",
                    tail_floor=1e-8):
    """The top-k + tail divergence, token by token: the student's K + 1 bucket masses are
    summed over the vocabulary (member or not), the teacher's tail is 1 - sum of its top-k."""
    p_BxTxV = np.exp(log_softmax(s_BxTxV, tau))
    b, t, v = p_BxTxV.shape
    per = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            ids = [int(x) for x in ids_BxTxK[i, j]]
            q = [float(np.exp(np.float64(x))) for x in lq_BxTxK[i, j]]
            p = [float(p_BxTxV[i, j, x]) for x in ids]
            if len(ids) < v:
                p.append(sum(float(p_BxTxV[i, j, x]) for x in range(v) if x not in ids))
                q.append(max(1.0 - sum(q), tail_floor))
            p, q = np.array(p), np.array(q)
            a, c = (p, q) if kind == "reverse" else (q, p)
            per[i, j] = sum(x * np.log(x / y) for x, y in zip(a, c) if x > 0)
    return aggregate(per, m, mode)
