"""Locust-style users: a class with weighted ``@task`` coroutines and a ``wait_time``.

Write your own the way you would for Locust (but async, and without importing Locust, which monkey-patches
sockets)::

    from glance_loadtest import ChatUser, task, between

    class CaptionUser(ChatUser):
        wait_time = between(0.5, 2.0)

        @task(5)
        async def caption(self):
            await self.chat(n_images=1, stream=True)

and pass ``--user-class mymodule:CaptionUser``. ``self.client`` is the run's gated client: each request it
sends takes one ticket of the run's request cap and a slot of ``--max-concurrency``; when the run is over it
raises :class:`StopUser`, which ends the user quietly.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    from .runner import Environment

TaskFn = Callable[["User"], Awaitable[Any]]


class StopUser(Exception):
    """Raised by the gated client once the run is over (time or request cap): ends the user."""


def task(weight: int | Callable = 1):
    """``@task`` or ``@task(weight)`` marks a coroutine method as a task picked with that weight."""
    if callable(weight):
        weight._task_weight = 1  # type: ignore[attr-defined]
        return weight

    def mark(fn):
        fn._task_weight = int(weight)
        return fn

    return mark


def constant(seconds: float) -> Callable[["User"], float]:
    return lambda _user: seconds


def between(lo: float, hi: float) -> Callable[["User"], float]:
    return lambda user: user.rng.uniform(lo, hi)


class User:
    """Base user: collects its ``@task`` methods; ``task_weights`` (name -> weight) from the run override them."""

    wait_time: Callable[["User"], float] = constant(0.0)

    def __init__(self, env: "Environment", user_id: int) -> None:
        self.env = env
        self.user_id = user_id
        self.client = env.client
        self.rng = random.Random(f"{env.config.seed}:{user_id}")
        weights = self.task_table(env.config.task_weights)
        self._names = list(weights)
        self._weights = [weights[n] for n in self._names]

    @classmethod
    def tasks(cls) -> dict[str, int]:
        """Declared tasks and weights (subclasses inherit and may override)."""
        found: dict[str, int] = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                if callable(value) and hasattr(value, "_task_weight"):
                    found[name] = value._task_weight
        return found

    @classmethod
    def task_table(cls, overrides: dict[str, float] | None = None) -> dict[str, float]:
        declared = cls.tasks()
        unknown = set(overrides or {}) - set(declared)
        if unknown:
            raise ValueError(f"unknown task(s) {sorted(unknown)} for {cls.__name__}; tasks: {', '.join(declared)}")
        table = {**declared, **(overrides or {})}
        table = {k: float(v) for k, v in table.items() if v > 0}
        if not table:
            raise ValueError(f"{cls.__name__} has no task with a positive weight")
        return table

    def pick(self) -> tuple[str, TaskFn]:
        name = self.rng.choices(self._names, weights=self._weights)[0]
        return name, getattr(type(self), name)

    async def on_start(self) -> None:
        """Called once when the user is spawned."""


class ChatUser(User):
    """The default user: chats with one image (weight 3), two images (1), text only (1); a multipart task
    (weight 0, enable it with ``--task-weights generate_multipart=1``). Streaming with the run's
    ``stream_fraction``."""

    async def chat(self, n_images: int, stream: bool | None = None, task_name: str | None = None):
        cfg = self.env.config
        if stream is None:
            stream = self.rng.random() < cfg.stream_fraction
        item = self.env.dataset.sample(n_images)
        return await self.client.chat(item, task=task_name or f"chat_{n_images}img", stream=stream,
                                      max_tokens=cfg.max_tokens, **self.env.request_options(self.rng))

    @task(3)
    async def chat_one_image(self):
        await self.chat(1, task_name="one_image")

    @task(1)
    async def chat_two_images(self):
        await self.chat(2, task_name="two_images")

    @task(1)
    async def chat_text(self):
        await self.chat(0, task_name="text")

    @task(0)
    async def generate_multipart(self):
        cfg = self.env.config
        await self.client.generate(self.env.dataset.sample(1), task="multipart", max_tokens=cfg.max_tokens,
                                   **self.env.request_options(self.rng))
