"""The engine's thread: `EngineWorker` steps the batch while requests run, and takes new ones
from the event loop without waiting for a step."""

from __future__ import annotations

import threading

from jaxformer.inference.engine import Engine, Request
from jaxformer.serve.errors import BadRequest, QueueFull


class EngineWorker:
  """Runs `engine.step()` on its own thread while any request is running or waiting.

  Args:
    engine: the continuous-batching engine.
    max_queue: waiting requests at most; `submit` refuses more.
  """

  def __init__(self, engine: Engine, max_queue: int):
    self.engine, self.max_queue = engine, max_queue
    self.cond = threading.Condition()
    self.stopping = False
    self.thread = threading.Thread(target=self._loop, name="jaxformer-engine", daemon=True)
    self.thread.start()

  def _loop(self) -> None:
    while True:
      with self.cond:
        while not self.engine.busy and not self.stopping:
          self.cond.wait()
        if self.stopping and not self.engine.busy:
          return
      # The step runs without the lock, so the event loop's `submit` never waits for a step.
      # The engine's queue is a deque (thread-safe appends) that only this thread pops.
      try:
        self.engine.step()
      except Exception as e:  # noqa: BLE001  (fail the requests, keep serving)
        self.engine.fail_all(f"decoding failed: {type(e).__name__}: {e}")

  def submit(self, requests: list[Request]) -> None:
    """Queues `requests`.

    Raises:
      BadRequest: more requests than the queue can ever hold.
      QueueFull: the waiting queue has no room for them now.
      ValueError: a request the engine refuses (`Engine.validate`); none of them is queued.
    """
    if len(requests) > self.max_queue:
      raise BadRequest(f"{len(requests)} texts in one request; send at most {self.max_queue} (the queue's size)")
    for r in requests:
      self.engine.validate(r)
    with self.cond:
      if len(self.engine.waiting) + len(requests) > self.max_queue:
        raise QueueFull(f"the queue is full ({self.max_queue} waiting requests); retry later")
      for r in requests:
        self.engine.submit(r)
      self.cond.notify()

  def stop(self) -> None:
    """Asks the engine thread to finish and waits for it."""
    with self.cond:
      self.stopping = True
      self.cond.notify()
    self.thread.join()
