"""Requests of an ImageService onto continuous batches (lantern.runtime.continuous): what a
serving replica runs instead of one generate call per batch of requests.

    scheduler = Scheduler(service)                 # starts its worker thread
    future = scheduler.submit(request)             # an ImageRequest from service.parse
    result = future.result()                       # ImageResult, or the exception it gets

One worker thread owns the engine. Each settings key (the request's key: settings, grid, prompt
length) gets a running batch of `slots` images (the service's largest batch size); a request's
images join free slots at a step boundary and leave the step they are done, so the batch stays
full while requests keep coming and a request that arrives one step late waits one step, not a
whole generation. Keys with work take turns one step at a time; at most MAX_BATCHES batches
are held at once (each holds its caches, memory-checked when it starts), and while another key
waits for one, the running batches stop admitting and drain. A request is answered when its last image is done (decoded
then, when the engine has a VQ decoder); a cancelled request's images leave their slots at the
next step boundary.

Every image depends on its own seed and settings only, so a served image equals
`Engine.generate` of its request alone (tests/test_scheduler.py)."""
import collections
import concurrent.futures
import logging
import queue
import threading
import time

import numpy as np

from lantern.runtime.continuous import ContinuousBatch
from lantern.runtime.errors import LanternError
from lantern.runtime.streams import image_seeds
from lantern.tools.image_service import _concat, Cancelled, ImageResult, RequestError

MAX_BATCHES = 4  # running batches (settings keys) held at once, each with its plan's caches
logger = logging.getLogger(__name__)


class _Job:
    """A request in flight: its future, and its images as they finish."""

    def __init__(self, request):
        self.request, self.future = request, concurrent.futures.Future()
        self.tokens = [None] * request.images
        self.stats = []
        self.left = request.images


class Scheduler:
    def __init__(self, service, slots=None):
        self.service, self.engine = service, service.engine
        self.slots = slots or max(service.sizes)
        self.inbox = queue.Queue()
        self.pending = collections.OrderedDict()  # key -> deque of (job, image index) not yet admitted
        self.batches = {}  # key -> ContinuousBatch
        self.turn = collections.deque()  # keys in the order they take steps
        self.steps = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._work, name="lantern-scheduler", daemon=True)
        self.thread.start()

    def submit(self, request):
        """The request's future (ImageResult, or the exception it gets). Running from here on: a
        client that goes away sets request.cancelled (its images leave at the next step); the
        future itself cannot be cancelled, so answering it never races a cancellation."""
        job = _Job(request)
        job.future.set_running_or_notify_cancel()
        self.inbox.put(job)
        return job.future

    def close(self):
        """Stop the worker and let the batches' plans go (requests still in flight are not answered)."""
        self._stop.set()
        self.inbox.put(None)
        self.thread.join()
        for batch in self.batches.values():
            batch.close()

    # -- the worker ------------------------------------------------------------------------------
    def _work(self):
        while not self._stop.is_set():
            key = None
            try:
                busy = any(b.running for b in self.batches.values()) or any(self.pending.values())
                self._take(block=not busy)
                self._drop_cancelled()
                key = self._next_key()
                if key is None:
                    continue
                self._admit(key)
                self._step(key)
            except Exception as e:  # noqa: BLE001 -- the failure belongs to this batch's requests (all, outside one)
                for failed in [key] if key is not None else list(self.batches) + list(self.pending):
                    self._fail(failed, e)

    def _take(self, block):
        """New requests from the inbox (waiting for one when there is nothing else to do)."""
        try:
            job = self.inbox.get(block=block)
            while True:
                if job is not None:
                    images = self.pending.setdefault(job.request.key, collections.deque())
                    images.extend((job, j) for j in range(job.request.images))
                    if job.request.key not in self.turn:
                        self.turn.append(job.request.key)
                job = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _next_key(self):
        """The next key with work, in turn."""
        for _ in range(len(self.turn)):
            key = self.turn[0]
            self.turn.rotate(-1)
            batch = self.batches.get(key)
            if (batch is not None and batch.running) or self.pending.get(key):
                if batch is None and len(self.batches) >= MAX_BATCHES and not self._free_a_batch():
                    continue  # waits until a running batch drains
                return key
            if batch is not None:  # idle: let its caches go
                batch.close()
                del self.batches[key]
            if not self.pending.get(key):
                self.pending.pop(key, None)
                self.turn.remove(key)
        return None

    def _free_a_batch(self):
        for key, batch in list(self.batches.items()):
            if not batch.running:
                batch.close()
                del self.batches[key]
                return True
        return False

    def _admit(self, key):
        waiting = self.pending.get(key)
        if not waiting:
            return
        others_wait = any(k not in self.batches and q for k, q in self.pending.items() if k != key)
        batch = self.batches.get(key)
        if batch is None:
            request = waiting[0][0].request
            batch = self.batches[key] = ContinuousBatch(self.engine, request.settings, self.slots,
                                                        self.service.tree_for(request), self.service.sizes)
        elif others_wait and len(self.batches) >= MAX_BATCHES:
            return  # drain, so the waiting key gets a batch
        if any(job.future.done() for job, _ in waiting):  # answered already (another of its images failed)
            self.pending[key] = waiting = collections.deque(x for x in waiting if not x[0].future.done())
        group = list(waiting)[: batch.free]
        try:
            joined = batch.admit_many([self._image(job, j) for job, j in group])
        except LanternError:  # one at a time, so the failure is only that image's request's
            joined = 0
            for job, j in group:
                try:
                    if not batch.admit_many([self._image(job, j)]):
                        break
                except LanternError as e:  # parse checked the condition: what is left is the server's (memory)
                    self._finish_with(job, RequestError(503, self.service.public(str(e))))
                joined += 1
        for _ in range(joined):
            waiting.popleft()
        if not joined and not batch.running:  # its plan does not hold the next image: a new one will
            batch.close()
            del self.batches[key]

    @staticmethod
    def _image(job, j):
        r = job.request
        return _one_image(r.condition, j), image_seeds(r.seed, r.images)[j], (job, j)

    def _step(self, key):
        batch = self.batches[key]
        if not batch.running:
            return
        answered = []
        for done in batch.step():
            job, j = done.tag
            if job.future.done():
                continue
            job.tokens[j] = done.tokens[0]
            job.stats.append(done.stats)
            job.left -= 1
            if job.left == 0:
                answered.append(job)
        self.steps += 1
        if answered:
            try:
                self._answer(answered, batch)
            except Exception:  # noqa: BLE001 -- e.g. decoding them at once needs more memory than there is
                for job in [j for j in answered if not j.future.done()]:  # one by one
                    try:
                        self._answer([job], batch)
                    except Exception as e:  # noqa: BLE001 -- this request's failure
                        logger.error("request %s failed: %s: %s", job.request.request_id, type(e).__name__, e)
                        self._finish_with(job, RequestError(503, self.service.public(str(e))))

    def _answer(self, jobs, batch):
        """The requests done this step, their images decoded in one call."""
        codes = [np.stack(job.tokens) for job in jobs]
        images = sum(len(c) for c in codes)
        decode_seconds, pictures = 0.0, [None] * len(jobs)
        if "vq_decoder" in self.engine.manifest.graphs:
            start = time.perf_counter()
            decoded = self.engine.decode(np.concatenate(codes), batch.plan.prefix.grid)
            decode_seconds = time.perf_counter() - start
            pictures = np.split(decoded, np.cumsum([len(c) for c in codes])[:-1])
        for job, tokens, picture in zip(jobs, codes, pictures):
            s = job.stats
            stats = dict(batch.stats, images=len(tokens), continuous=True, batch_images=self.slots,
                         # the images it shared its steps with, on average, itself included
                         requested_images=float(np.mean([x["mean_running_images"] for x in s])),
                         steps_per_image=float(np.mean([x["steps_per_image"] for x in s])),
                         mean_accepted_length=float(np.mean([x["mean_accepted_length"] for x in s])),
                         generate_seconds=float(max(x["engine_seconds"] for x in s)),
                         decode_seconds=decode_seconds * len(tokens) / images,  # its share of the call
                         seconds=float(max(x["seconds"] for x in s)), phase_seconds={})
            job.future.set_result(ImageResult(job.request, tokens, picture, stats))

    def _drop_cancelled(self):
        for key, waiting in self.pending.items():
            for item in [x for x in waiting if x[0].request.cancelled.is_set()]:
                waiting.remove(item)
                self._finish_with(item[0], Cancelled("the client went away"))
        for batch in self.batches.values():
            for tag in [t for t in batch.owner if t is not None and t[0].request.cancelled.is_set()]:
                batch.cancel(tag)
                self._finish_with(tag[0], Cancelled("the client went away"))

    def _fail(self, key, error):
        logger.error("batch of %s failed: %s: %s", key, type(error).__name__, error)
        if not isinstance(error, RequestError):
            error = RequestError(503, self.service.public(str(error)))
        batch = self.batches.pop(key, None)
        jobs = {t[0] for t in batch.owner if t is not None} if batch is not None else set()
        jobs |= {job for job, _ in self.pending.pop(key, ())}
        for job in jobs:
            self._finish_with(job, error)
        if key in self.turn:
            self.turn.remove(key)
        if batch is not None:
            try:
                batch.close()
            except Exception:  # noqa: BLE001 -- already failing; the next batch makes a new plan
                pass

    def _finish_with(self, job, error):
        """Answer a request with its error; its images still in slots leave them."""
        if job.future.done():
            return
        job.future.set_result(error)
        for batch in self.batches.values():
            for tag in [t for t in batch.owner if t is not None and t[0] is job]:
                batch.cancel(tag)


def _one_image(condition, j):
    """Image j's condition (generate's arguments for one image) from a request's per-image lists."""
    return _concat([{name: value if name == "grid" else [value[j]] for name, value in condition.items()}], pad=0)
