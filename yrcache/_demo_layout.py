"""What the processes of ``yrcache demo`` share: its settings and the store's layout.

No torch here: the parent imports this, and so does the fork server that
preloads the children's module (``_demo_rl``), without importing ``yrcache.demo``.

Keys, and named words (``store.word``):

- ``__rl__/policy/...``: the published weights (``WeightPublisher(store, "policy", keep=2)``).
- ``pub/<version>``: ``time.monotonic_ns()`` when the learner called ``publish()``
  (``CLOCK_MONOTONIC`` is one clock for every process of the node).
- ``exp/<actor>/<seq:08d>/{obs,act,rew,logp}``: one episode's arrays, then
  ``.../meta`` (version, terminated, steps, versions behind), written last:
  an episode whose ``meta`` exists is complete.
- word ``demo/exp/<actor>``: its value counts the episodes that actor has
  written (its next ``seq``); word ``demo/exp``: woken after each episode.
- ``stat/learner``, ``stat/actor/<k>``: JSON counters for the status line;
  word ``demo/stat`` is woken after each learner update.
- word ``demo/stop``: set to 1 (by the learner when done, or the parent) to stop the children.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DemoConfig"]


@dataclass(frozen=True)
class DemoConfig:
    """What a demo run does; pickled to every child, so plain values only."""

    actors: int = 2              # actor processes
    updates: int = 40            # learner updates (versions published: updates + 1)
    batch_steps: int = 2048      # environment steps per update
    max_staleness: int = 1       # versions an actor's data may lag the learner
    ttl: float = 10.0            # seconds replay stays readable
    dram: str = "1MiB"           # the store's DRAM tier
    ssd_size: str = "64MiB"      # the store's SSD tier (in a temporary directory)
    seed: int = 0
    epochs: int = 10             # PPO passes over each batch
    minibatch: int = 256
    lr: float = 1e-3             # Adam, annealed linearly to 0 over the updates


WEIGHTS = "policy"            # the yrcache.rl weight set
EXP_FIELDS = ("meta", "obs", "act", "rew", "logp")
EXP_PRIORITY = -1             # replay: demoted and spilled before the policy (priority 0)
STAT_PRIORITY = 1
PUB_TTL = 60.0                # seconds a pub/<version> timestamp stays readable
STOP_WORD, EXP_WORD, STAT_WORD = "demo/stop", "demo/exp", "demo/stat"
LEARNER_STAT = "stat/learner"


def exp_key(actor: int, seq: int, field: str) -> str:
    """The key of one array of episode ``seq`` of ``actor``."""
    return f"exp/{actor}/{seq:08d}/{field}"


def count_word(actor: int) -> str:
    """The named word whose value counts the episodes ``actor`` has written."""
    return f"demo/exp/{actor}"


def pub_key(version: int) -> str:
    """The key holding when ``publish()`` of ``version`` was called (monotonic ns)."""
    return f"pub/{version}"


def actor_stat_key(actor: int) -> str:
    """The key of ``actor``'s JSON counters."""
    return f"stat/actor/{actor}"
