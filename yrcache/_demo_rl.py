"""The child processes of ``yrcache demo``: a PPO learner and CartPole actors.

Imported only in the children and their fork server (it needs torch and
gymnasium); the keys and words they share are in ``yrcache/_demo_layout.py``.
Everything they exchange goes through the store: weights through
``yrcache.rl``, episodes as arrays under ``exp/``, counters as JSON under
``stat/``.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from ._demo_layout import (EXP_FIELDS, EXP_PRIORITY, EXP_WORD, LEARNER_STAT, PUB_TTL, STAT_PRIORITY,
                           STAT_WORD, STOP_WORD, WEIGHTS, DemoConfig, actor_stat_key, count_word, exp_key,
                           pub_key)
from .errors import StoreFullError
from .rl import WeightPublisher, WeightSubscriber
from .store import TieredStore

OBS_DIM, N_ACTIONS, HIDDEN = 4, 2, 64
GAMMA, LAMBDA, CLIP = 0.99, 0.95, 0.2
VALUE_COEF, MAX_GRAD_NORM = 0.5, 0.5
SOLVED = 475.0            # CartPole-v1's reward threshold: "solved" = 3 updates in a row averaging it
WAIT_SLICE = 0.2          # seconds between checks of the stop word while waiting
REPORT_EVERY = 0.25       # seconds between an actor's counter updates
LATENCY_KEEP = 4096       # latencies an actor reports (the newest)


def mlp(out: int) -> nn.Sequential:
    """4 -> 64 -> 64 -> ``out``, tanh: the policy (out=2) and the value function (out=1)."""
    return nn.Sequential(nn.Linear(OBS_DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, out))


def _put_json(store: TieredStore, key: str, d: dict[str, Any]) -> None:
    store.put(key, json.dumps(d).encode(), priority=STAT_PRIORITY)


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


# ------------------------------------------------------------------ actor

class _Buffers(NamedTuple):
    obs: np.ndarray      # (T + 1, 4) float32: the observations, the last one after the final step
    act: np.ndarray      # (T,) uint8
    rew: np.ndarray      # (T,) float32
    logp: np.ndarray     # (T,) float32: log-probability of the action under the acting policy


def _episode(env: Any, obs: np.ndarray, w: list[np.ndarray], rng: np.random.Generator,
             buf: _Buffers) -> tuple[int, bool]:
    """Play one episode from ``obs`` into ``buf``; return (steps, terminated).

    The forward pass runs in numpy over views of the policy's parameter
    tensors (the same memory ``fetch(into=)`` wrote): a torch call per step
    costs about 10x a numpy one at this size.
    """
    w0, b0, w1, b1, w2, b2 = w
    t = 0
    while True:
        buf.obs[t] = obs
        h = np.tanh(w0 @ obs + b0)
        h = np.tanh(w1 @ h + b1)
        logits = w2 @ h + b2
        d = float(logits[1] - logits[0])                 # log-odds of action 1
        lp1 = _log_sigmoid(d)
        a = 1 if rng.random() < math.exp(lp1) else 0
        obs, r, terminated, truncated, _ = env.step(a)
        buf.act[t], buf.rew[t] = a, r
        buf.logp[t] = lp1 if a else _log_sigmoid(-d)
        t += 1
        if terminated or truncated:
            buf.obs[t] = obs
            return t, bool(terminated)


def _write_episode(store: TieredStore, cfg: DemoConfig, index: int, seq: int, buf: _Buffers, steps: int,
                   meta: np.ndarray) -> bool:
    """Put one episode's arrays (``meta`` last); False, with nothing left behind, when the store is full.

    One ``put`` per array (one copy each into the arena), not ``mset``: a
    ``put`` that takes DRAM past its high watermark spills cold replay to
    the SSD itself, so the actors pay for the room they use, not the
    learner's next ``publish()``.
    """
    arrays = {"obs": buf.obs[:steps + 1], "act": buf.act[:steps], "rew": buf.rew[:steps],
              "logp": buf.logp[:steps], "meta": meta}
    try:
        for field, value in arrays.items():
            store.put(exp_key(index, seq, field), value, priority=EXP_PRIORITY, ttl=cfg.ttl)
        return True
    except StoreFullError:
        for field in arrays:
            store.delete(exp_key(index, seq, field))
        return False


def run_actor(store: TieredStore, cfg: DemoConfig, index: int, parent: int) -> None:
    """Actor ``index``: follow the newest policy, write an episode at a time.

    Before each episode it asks for the newest version: while it has played
    fewer than its share of a batch (``batch_steps / actors`` steps) on the
    current one, ``wait(newer_than=cur, max_staleness=...)`` returns at once
    (the newest version, or ``cur`` while a publish is in flight); after its
    share it sleeps in ``wait(newer_than=cur)`` until the learner publishes.
    A new version is fetched straight into the policy's parameters.  An
    episode that finds the store full (replay has not aged out yet) is
    dropped and counted, and the actor backs off for a moment.
    """
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    max_t = int(env.spec.max_episode_steps or 500) if env.spec is not None else 500
    rng = np.random.default_rng([cfg.seed, index + 1])
    obs, _ = env.reset(seed=cfg.seed * 1000 + index + 1)
    policy = mlp(N_ACTIONS).requires_grad_(False)
    into = {name: p.data for name, p in policy.named_parameters()}
    w = [t.numpy() for t in into.values()]               # views: the same memory
    buf = _Buffers(np.empty((max_t + 1, OBS_DIM), np.float32), np.empty(max_t, np.uint8),
                   np.empty(max_t, np.float32), np.empty(max_t, np.float32))
    sub = WeightSubscriber(store, WEIGHTS)
    stop, wake, count = store.word(STOP_WORD), store.word(EXP_WORD), store.word(count_word(index))
    share = -(-cfg.batch_steps // cfg.actors)
    cur, on_cur, seq = -1, 0, 0
    # lat: [version, ms from publish() called to the weights in our parameters,
    #       1 if we were asleep in wait(), ms the fetch() itself took]
    st: dict[str, Any] = {"version": -1, "fetches": 0, "episodes": 0, "steps": 0, "behind_sum": 0,
                          "behind_max": 0, "store_full": 0, "lat": []}
    reported = 0.0

    def report() -> None:
        st["lat"] = st["lat"][-LATENCY_KEEP:]
        _put_json(store, actor_stat_key(index), st)

    while not stop.value and os.getppid() == parent:
        waiting = cur >= 0 and on_cur >= share
        try:
            if cur < 0:
                v = sub.wait(timeout=WAIT_SLICE)
            elif waiting:
                v = sub.wait(newer_than=cur, timeout=WAIT_SLICE)
            else:
                v = sub.wait(newer_than=cur, timeout=WAIT_SLICE, max_staleness=cfg.max_staleness)
        except TimeoutError:
            continue
        if v != cur:
            try:
                sub.fetch(v, into=into)
            except KeyError:             # reclaimed meanwhile (keep=2): wait for the newest
                continue
            held = time.monotonic_ns()
            published = store.get(pub_key(v))
            if cur >= 0 and published is not None:   # (not for the version this actor joined at)
                st["lat"].append([v, round((held - int(published)) / 1e6, 3), int(waiting),
                                  round(sub.last_fetch_stats["seconds"] * 1e3, 3)])
            cur, on_cur = v, 0
            st["version"], st["fetches"] = v, st["fetches"] + 1
        steps, terminated = _episode(env, obs, w, rng, buf)
        obs, _ = env.reset()
        behind = (sub.latest() or cur) - cur      # versions published while it played
        meta = np.array([cur, terminated, steps, behind], np.int64)
        if not _write_episode(store, cfg, index, seq, buf, steps, meta):
            st["store_full"] += 1
            time.sleep(WAIT_SLICE)
            continue
        seq += 1
        count.cas(seq - 1, seq)                   # the learner reads episodes below this count
        wake.wake()
        on_cur += steps
        st["episodes"], st["steps"] = seq, st["steps"] + steps
        st["behind_sum"] += behind
        st["behind_max"] = max(st["behind_max"], behind)
        now = time.monotonic()
        if now >= reported + REPORT_EVERY:
            report()
            reported = now
    report()


# ---------------------------------------------------------------- learner

class _Episode(NamedTuple):
    version: int
    terminated: bool
    obs: np.ndarray
    act: np.ndarray
    rew: np.ndarray
    logp: np.ndarray


class _Learner:
    """PPO (clipped objective, GAE, a separate value network) fed from the store."""

    def __init__(self, store: TieredStore, cfg: DemoConfig, parent: int) -> None:
        torch.manual_seed(cfg.seed)
        self.store, self.cfg, self.parent = store, cfg, parent
        self.pi, self.vf = mlp(N_ACTIONS), mlp(1)
        with torch.no_grad():                 # a near-uniform first policy
            last = self.pi[-1]
            assert isinstance(last, nn.Linear)
            last.weight.mul_(0.01)
            last.bias.zero_()
        self.params = [*self.pi.parameters(), *self.vf.parameters()]
        self.opt = torch.optim.Adam(self.params, lr=cfg.lr, eps=1e-5)
        self.pub = WeightPublisher(store, WEIGHTS, keep=2)
        self.stop, self.wake = store.word(STOP_WORD), store.word(EXP_WORD)
        self.counts = [store.word(count_word(k)) for k in range(cfg.actors)]
        self.cursors = [0] * cfg.actors
        self.st: dict[str, Any] = {"version": -1, "updates": 0, "returns": [], "episodes": 0, "steps": 0,
                                   "dropped_stale": 0, "lost": 0, "stale_hist": [0] * (cfg.max_staleness + 1),
                                   "solved_update": None, "solved_t": None, "train_s": 0.0,
                                   "publish_ms": [], "store_full": 0}

    def publish(self, version: int) -> None:
        """Record when, then publish the policy as ``version`` (the value function stays here)."""
        state = {name: p.detach() for name, p in self.pi.named_parameters()}
        deadline = time.monotonic() + self.cfg.ttl + 10.0
        while True:
            cpu0 = time.thread_time_ns()
            t0 = time.monotonic_ns()
            try:
                self.store.put(pub_key(version), np.array(t0, np.int64), ttl=PUB_TTL)
                self.pub.publish(state, version=version)
                break
            except StoreFullError:           # replay fills DRAM (and SSD): wait until some ages out
                if time.monotonic() > deadline or self._stopped():
                    raise
                self.st["store_full"] += 1
                time.sleep(WAIT_SLICE)
        self.st["version"] = version
        # CPU time, not wall time: the actors it wakes may take both cores before it returns.
        self.st["publish_ms"].append(round((time.thread_time_ns() - cpu0) / 1e6, 3))

    def report(self) -> None:
        _put_json(self.store, LEARNER_STAT, self.st)
        self.store.word(STAT_WORD).wake()

    def _stopped(self) -> bool:
        return bool(self.stop.value) or os.getppid() != self.parent

    def collect(self, version: int) -> list[_Episode] | None:
        """At least ``batch_steps`` steps of episodes at most ``max_staleness``
        versions older than ``version``, taken in turn from each actor in the
        order written; None when told to stop.  Sleeps on the ``demo/exp``
        word while nothing new is there."""
        cfg, st = self.cfg, self.st
        eps: list[_Episode] = []
        steps = 0
        while True:
            seen = self.wake.seq                 # before looking: no lost wake-up
            progress = True
            while progress and steps < cfg.batch_steps:
                progress = False
                for k, count in enumerate(self.counts):
                    if self.cursors[k] >= count.value or steps >= cfg.batch_steps:
                        continue
                    seq = self.cursors[k]
                    self.cursors[k] += 1
                    progress = True
                    meta, obs, act, rew, logp = self.store.mget([exp_key(k, seq, f) for f in EXP_FIELDS])
                    if meta is None or obs is None or act is None or rew is None or logp is None:
                        st["lost"] += 1            # expired before it was read
                        continue
                    stale = version - int(meta[0])
                    if stale > cfg.max_staleness:
                        st["dropped_stale"] += 1
                        continue
                    st["stale_hist"][stale] += 1
                    eps.append(_Episode(int(meta[0]), bool(meta[1]), obs, act, rew, logp))
                    steps += len(act)
            if steps >= cfg.batch_steps:
                return eps
            if self._stopped():
                return None
            self.wake.wait(seen, WAIT_SLICE)

    def train(self, eps: list[_Episode]) -> None:
        """PPO epochs over the batch; advantages by GAE, bootstrapped at truncation."""
        cfg = self.cfg
        obs_all = np.concatenate([e.obs for e in eps])         # one copy out of the arena
        with torch.no_grad():
            values = self.vf(torch.from_numpy(obs_all)).squeeze(-1).numpy()
        advs, rets = [], []
        at = 0
        for e in eps:
            n = len(e.act)
            v = values[at:at + n + 1].copy()
            at += n + 1
            if e.terminated:
                v[-1] = 0.0                                    # no future after a fall
            delta = e.rew + GAMMA * v[1:] - v[:-1]
            adv = np.empty(n, np.float32)
            g = 0.0
            for t in range(n - 1, -1, -1):
                g = float(delta[t]) + GAMMA * LAMBDA * g
                adv[t] = g
            advs.append(adv)
            rets.append(adv + v[:-1])
        obs = torch.from_numpy(np.concatenate([e.obs[:-1] for e in eps]))
        act = torch.from_numpy(np.concatenate([e.act for e in eps]).astype(np.int64))
        old_logp = torch.from_numpy(np.concatenate([e.logp for e in eps]))
        adv_t = torch.from_numpy(np.concatenate(advs))
        adv_t = (adv_t - adv_t.mean()) / (adv_t.std() + 1e-8)
        ret_t = torch.from_numpy(np.concatenate(rets))
        n = len(act)
        for _ in range(cfg.epochs):
            perm = torch.randperm(n)
            for i in range(0, n, cfg.minibatch):
                idx = perm[i:i + cfg.minibatch]
                logits = self.pi(obs[idx])
                logp = torch.log_softmax(logits, -1).gather(1, act[idx, None]).squeeze(1)
                ratio = torch.exp(logp - old_logp[idx])
                a = adv_t[idx]
                pg_loss = -torch.min(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a).mean()
                v_loss = ((self.vf(obs[idx]).squeeze(-1) - ret_t[idx]) ** 2).mean()
                loss = pg_loss + VALUE_COEF * v_loss
                self.opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM)
                self.opt.step()

    def run(self) -> None:
        cfg, st = self.cfg, self.st
        self.publish(0)
        self.report()
        for u in range(1, cfg.updates + 1):
            eps = self.collect(u - 1)
            if eps is None:
                return
            t0 = time.perf_counter()
            for g in self.opt.param_groups:
                g["lr"] = cfg.lr * (1.0 - (u - 1) / cfg.updates)
            self.train(eps)
            st["train_s"] = round(st["train_s"] + time.perf_counter() - t0, 3)
            st["returns"].append(float(np.mean([e.rew.sum() for e in eps])))
            st["episodes"] += len(eps)
            st["steps"] += sum(len(e.act) for e in eps)
            st["updates"] = u
            recent = st["returns"][-3:]
            if st["solved_update"] is None and len(recent) == 3 and min(recent) >= SOLVED:
                st["solved_update"], st["solved_t"] = u, time.monotonic()
            self.publish(u)
            self.report()
        self.stop.cas(0, 1)                  # the actors finish their episode and exit


def run_learner(store: TieredStore, cfg: DemoConfig, parent: int) -> None:
    """The learner process: publish version 0, then ``cfg.updates`` PPO updates, each published."""
    _Learner(store, cfg, parent).run()
