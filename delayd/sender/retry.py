"""When a failed message is sent again, when it is given up, and where it goes then.

A message whose send failed (its group unavailable, or a retryable refusal) is sent
again — on another group when there is one — after a capped, jittered exponential
back-off; after ``max_attempts`` sends it goes to its dead-letter subject, ``DLQ.`` +
its subject, and is counted (never a silent drop, DESIGN.md). The dead-letter subject
is an ordinary subject: consumers subscribe to it like to any other, as to RocketMQ's
``%DLQ%<group>`` topics.

Pure logic: the randomness comes in as a ``random.Random``, so tests pin the schedule.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from delayd.protocol import MAX_SUBJECT_LENGTH, validate_subject

DEAD_LETTER_PREFIX = "DLQ."
# The longest subject that has a dead-letter subject: 255 - 4 = 251 characters.
MAX_DEAD_LETTERED_SUBJECT_LENGTH = MAX_SUBJECT_LENGTH - len(DEAD_LETTER_PREFIX)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how far apart a message is sent before it is dead-lettered.

    ``max_attempts`` counts sends, the first included (1: never retried). The retry
    after attempt ``n`` waits ``delay_ms(n, rng)``. Raises ValueError unless
    ``max_attempts >= 1``, ``0 <= base_ms <= max_ms`` (milliseconds) and
    ``0 <= jitter <= 1``.
    """

    max_attempts: int = 5
    base_ms: int = 100
    max_ms: int = 30_000
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if not 0 <= self.base_ms <= self.max_ms:
            raise ValueError(
                f"need 0 <= base_ms <= max_ms (milliseconds), got {self.base_ms} and {self.max_ms}"
            )
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be a fraction in [0, 1], got {self.jitter}")

    def delay_ms(self, attempt: int, rng: random.Random) -> int:
        """Milliseconds to wait before retry number ``attempt`` (1: the first retry).

        ``base_ms * 2**(attempt - 1)`` capped at ``max_ms``, then moved by a uniform
        ±``jitter`` fraction so that messages that failed together are not all retried
        in the same instant, and kept within ``[0, max_ms]``: ``max_ms`` is a hard bound
        (near the cap the jitter only shortens). Raises ValueError for ``attempt < 1``.
        """
        if attempt < 1:
            raise ValueError(f"attempt counts retries from 1, got {attempt}")
        # 2**62 ms is longer than any max_ms; capping the exponent keeps the integer small.
        nominal = min(self.max_ms, self.base_ms << min(attempt - 1, 62))
        spread = 1.0 + self.jitter * (2.0 * rng.random() - 1.0)
        return max(0, min(self.max_ms, round(nominal * spread)))

    def exhausted(self, attempts: int) -> bool:
        """Whether a message sent ``attempts`` times without success is to be
        dead-lettered rather than sent again."""
        return attempts >= self.max_attempts


def dead_letter_subject(subject: str) -> str:
    """The subject dead-lettered messages of ``subject`` go to: ``DLQ.<subject>``.

    The name is the subject with a fixed prefix, so an operator finds the dead letters
    of ``orders`` in ``DLQ.orders`` without a lookup table. It is valid for every valid
    subject of at most MAX_DEAD_LETTERED_SUBJECT_LENGTH (251) characters: the prefix is
    valid subject text and a subject never starts with ``.``. A longer subject has no
    dead-letter subject and raises ValueError — cutting it short, or hashing it, would
    mix the dead letters of different subjects, or hide where they came from. So the
    delay server has to refuse longer subjects when it receives a message, while the
    producer can still act on the refusal: every message it accepts can then be
    dead-lettered. Raises ValueError for an invalid subject too.
    """
    problem = validate_subject(subject)
    if problem is not None:
        raise ValueError(f"no dead-letter subject for an invalid subject: {problem}")
    if len(subject) > MAX_DEAD_LETTERED_SUBJECT_LENGTH:
        raise ValueError(
            f"subject is {len(subject)} characters long; a dead-letter subject "
            f"({DEAD_LETTER_PREFIX!r} + subject) exists only for subjects of at most "
            f"{MAX_DEAD_LETTERED_SUBJECT_LENGTH} characters"
        )
    return DEAD_LETTER_PREFIX + subject
