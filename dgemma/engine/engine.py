"""The batched generation loop: requests join at canvas boundaries, requests at different denoising steps
share one forward, finished or cancelled ones leave at once.

The parts, as in nano-vllm: request.py (one request's state), scheduler.py (the queue, free cache rows,
cancellation, which requests step together), runner.py (the model and its cache), and this loop.
Each iteration (`step`):
  1. drop cancelled requests; admit waiting requests into free cache rows; read the next chunk of the
     oldest prompts not yet in their rows (a prompt starts from the prefix cache, prefix_cache.py, and
     encodes the rest `prefill_budget` tokens a step, so running requests keep stepping while a long
     prompt is read) and start the first canvas of each prompt now all in (one whose last chunk was
     read beside running requests starts at the next iteration, so that iteration is not also longer by
     the new row's step);
  2. one decoder forward over every active row, then each row's own sampler step (its temperature, its
     generator) and stop rule; the host reads the device once per step, for the stop flags, the
     accepted counts and the argmax canvases together (`dgemma.device_sync`; tests/test_syncs.py);
  3. rows whose canvas stopped commit it: one batched causal encode for those that continue, a new canvas
     for each; rows that produced EOS or reached max_new_tokens finish and free their row.

Scoring requests (evaluation harnesses) take rows too, but are not continued: those admitted in one step
are scored together by the causal encoder (scoring.py), one chunk per step beside the denoising forward,
and leave when scored.

Every request owns a torch.Generator, so its draws do not depend on what else is in the batch: a
request with seed s yields what `dgemma.generation.generate` yields for that prompt alone with seed s, up
to float rounding, which the batch and the prefix cache move (on a large model that can flip a draw;
`deterministic` rules it out, runner.py).
A request with a `constraint` (dgemma.structured) is guided and committed through its ConstrainedAnswer,
exactly as the plain loop does it. A request's `images` are encoded with its prompt (the vision tower runs
in its prefill) and released; from then on it steps like any other row.
A request with a `verifier` is checked when its output is complete; a rejected output is denoised
again with the accepted positions kept (dgemma.generation.verify says how), and candidates of one prompt
(a Search, search.py) step side by side until one is accepted.
`submit` and `cancel` may be called from other threads; `step` runs on one.
"""

from __future__ import annotations

import time

import torch

from dgemma.compilation.steps import compiled_function
from dgemma.config import SamplingConfig
from dgemma.device_sync import host_read, to_device
from dgemma.engine.request import Event, Request, ScoreRequest, Status
from dgemma.engine.prefix_cache import default_budget
from dgemma.engine.runner import Runner
from dgemma.engine.scheduler import PrefillPace, Scheduler
from dgemma.engine.scoring import SCORE_CHUNK_TOKENS, ScoringBatch
from dgemma.engine.search import Search
from dgemma.generation.canvas import columns_left, cut_at_eos, pad_after_eos_host, positions_needed, template_slice
from dgemma.generation.denoising import CanvasDenoising
from dgemma.generation.step_cache import active_counts, packed_step
from dgemma.generation.verify import check_search, next_template, rejected_positions, verifiers_for
from dgemma.sampling import seed_or_random
from dgemma.sampling.sampler import scan_logits


def _prompt_seed(seeds: list[int] | None, sampling: SamplingConfig, i: int) -> int:
    """Prompt i's seed in a batch call: seeds[i], else sampling.seed + i, else random."""
    return seed_or_random(None if seeds is None else seeds[i], None if sampling.seed is None else sampling.seed + i)


class Engine:
    def __init__(self, model, *, max_batch: int = 8, max_length: int | None = None, max_queue: int = 64,
                 score_chunk_tokens: int = SCORE_CHUNK_TOKENS, prefix_cache_bytes: int | str = 0,
                 prefill_chunk: int | None = None, deterministic: bool = False):
        self.model = model
        self.canvas_length = model.config.canvas_length
        self.vocab_size = model.config.vocab_size
        max_length = max_length or min(model.config.max_position_embeddings, 8192)
        # deterministic: every encoder call one row's aligned canvas-long span, and one decoder forward a row
        # (runner.py), so a request's tokens depend on its prompt and seed alone: not on what was cached,
        # how its prompt was chunked or what else runs
        self.deterministic = deterministic
        # the prefix cache's budget: 0 (the default) keeps no cache, "auto" takes what the commands take
        # (prefix_cache.default_budget: a quarter of the free memory, at most 16 GiB)
        if prefix_cache_bytes == "auto":
            prefix_cache_bytes = default_budget(model)
        self.runner = Runner(model, max_batch, max_length, prefix_cache_bytes,
                             span_tokens=self.canvas_length if deterministic else None)
        # prompt tokens encoded per step (None: the engine's choice, `prefill_budget`)
        self.prefill_chunk = prefill_chunk
        self.pace = PrefillPace(self.canvas_length)
        self.scheduler = Scheduler(max_batch, max_queue)
        self.forwards = 0  # decoder forwards run, for benchmarks
        self.decoder_positions = 0  # canvas positions run through the decoder (/metrics, benchmarks)
        self.scoring: list[ScoringBatch] = []  # batches of scoring requests in progress, oldest first
        self.scored_tokens = 0  # prompt tokens the encoder ran for scoring (shared prefixes once), for benchmarks
        self.score_chunk_tokens = score_chunk_tokens
        # a model whose decoder is compiled gets a compiled sampler scan too (the step's other fused part)
        self.scan = compiled_function(model, scan_logits, dynamic=True, options=None)

    @property
    def prefix_cache(self):
        """The PrefixCache (its `stats`: blocks, hits, evictions), or None when off."""
        return self.runner.prefix_cache

    @property
    def max_length(self) -> int:
        return self.runner.cache.max_length

    # the scheduler's state, as a serving loop and tests look at it
    @property
    def active(self) -> list[Request]:
        return self.scheduler.active

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def free_rows(self) -> list[int]:
        return self.scheduler.free_rows

    @property
    def wakeup(self):
        return self.scheduler.wakeup

    def tokens_needed(self, prompt_len: int, sampling: SamplingConfig) -> int:
        return positions_needed(prompt_len, sampling.max_new_tokens, self.canvas_length)

    # -- requests in and out (any thread) ----------------------------------------------------
    def submit(self, request: Request) -> Request:
        self.check_fits(request)
        self.scheduler.add(request)
        return request

    def submit_all(self, requests: list[Request]) -> list[Request]:
        """Queue requests together, all or none (QueueFull when they do not all fit the queue)."""
        for r in requests:
            self.check_fits(r)
        self.scheduler.add_all(requests)
        return requests

    def check_fits(self, request: Request):
        """ValueError when the request can never fit a cache row."""
        if not request.prompt:
            raise ValueError("the prompt is empty")
        if request.scoring:
            if len(request.prompt) > self.max_length:
                raise ValueError(f"a prompt of {len(request.prompt)} tokens does not fit: the engine holds "
                                 f"{self.max_length} positions")
            return
        if request.constraint is not None and (request.fixed is not None or request.verifier is not None):
            raise ValueError("a canvas template or a verifier cannot be combined with a constraint")
        check_search(request.max_rounds, 1)
        self._check_images(request)
        refusal = self.model.step_cache_refusal(request.adapter) if request.sampling.step_cache else None
        if refusal is not None:  # a step-cache forward holds step-cache rows alone (`_step_logits`)
            raise ValueError(refusal)
        need = self.tokens_needed(len(request.prompt), request.sampling)
        if need > self.max_length:
            raise ValueError(
                f"prompt of {len(request.prompt)} tokens + max_new_tokens {request.sampling.max_new_tokens} "
                f"(rounded up to whole canvases of {self.canvas_length}) needs {need} positions; "
                f"the engine holds {self.max_length}"
            )

    def cancel(self, request: Request):
        self.scheduler.cancel(request)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop (one thread) -----------------------------------------------------------------
    def step(self):
        for r in self.active:  # verifier candidates that can no longer win leave now
            if not r.scoring and r.search is not None and r.search.cannot_win(r):
                r.state.cancel_requested = True
        for r in self.scheduler.take_cancelled():
            if not (r.scoring and r.state.row is not None):  # a batch being scored finishes its own requests
                self._finish(r, "cancelled")
        to_score = []
        for r in self.scheduler.admit():
            if r.scoring:
                to_score.append(r)
                continue
            r.state.generator = torch.Generator(device=self.model.device).manual_seed(r.seed)
            if r.constraint is not None:
                from dgemma.structured.answer import ConstrainedAnswer

                r.state.answer = ConstrainedAnswer(r.constraint, r.sampling.eos_token_ids, r.sampling.pad_token_id)
        if to_score:
            self.scoring.append(ScoringBatch(to_score, self.score_chunk_tokens, self.runner))
        if self.scoring:
            self._score_step()
        start = time.perf_counter()
        read = self._prefill_step()
        if self.generating:
            self._denoise_step()  # ends in a read of the device: the time since `start` is the work's
            if self.prefill_chunk is None:  # a fixed chunk needs no pace
                self.pace.observe(read, time.perf_counter() - start)

    @property
    def generating(self) -> list[Request]:
        """Requests denoising: their prompts are in their rows and their canvases started."""
        return [r for r in self.active if not r.scoring and not r.prefilling and r.state.denoising is not None]

    def prefill_budget(self) -> int:
        """Prompt tokens to encode in this step: beside running requests, as many as take about one of
        their steps (`PrefillPace`, measured), so their steps go on between chunks at about twice their
        usual interval; 8 canvases' worth when nothing else runs. Either way a bound on the prefill's
        activations."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        return self.pace.chunk_tokens if self.generating else 8 * self.canvas_length

    def _prefill_step(self) -> int:
        """The next chunk of the oldest prompts not yet in their rows; a prompt all in starts its canvas.
        A prompt starts from the prefix cache when it reaches the front (after the prompts before it
        are in, so it finds what they left there). Returns the prompt tokens encoded."""
        budget = start_budget = self.prefill_budget()
        beside_running = bool(self.generating)
        for r in self.active:  # prompts read in the last iteration beside running requests start now
            st = r.state
            if not r.scoring and not r.prefilling and st.prefilled is not None and st.denoising is None:
                self._start_canvas(r)
        for r in [r for r in self.active if r.prefilling]:
            if budget <= 0:
                break
            st = r.state
            if st.prefilled is None:
                st.cached_tokens, st.prefill_images, _ = self.runner.start_row(st.row, r.prompt, st.images, r.adapter)
                st.prefilled = st.cached_tokens
            a = st.prefilled
            # images go in one call with every token after them (an image is encoded whole); aligned spans
            # are read whole (a chunk ends on a span bound)
            span = self.runner.span_tokens
            chunk = -(-budget // span) * span if span else budget
            n = len(r.prompt) - a if st.prefill_images is not None else min(chunk, len(r.prompt) - a)
            if n:
                self.runner.prefill(st.row, r.prompt[a : a + n], st.prefill_images)
            st.prefilled, st.prefill_images, budget = a + n, None, budget - n
            if not r.prefilling:
                if r.verifier is None:  # the pixels are in the cache now (a later round may encode them again)
                    st.images = None
                if not (beside_running and n):  # else next iteration: this one's time went to the chunk
                    self._start_canvas(r)
        return start_budget - budget

    def run_until_done(self, requests: list[Request]):
        while not all(r.done for r in requests):
            self.step()

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, *, seeds: list[int] | None = None,
                 templates=None, constraints=None, images=None, on_event=None, verifier=None, max_rounds: int = 1,
                 candidates: int = 1) -> list[Request]:
        """Convenience: submit every prompt (seed i defaults to sampling.seed + i, or random) and run.
        constraints[i]: prompt i's TokenAutomaton (dgemma.structured) or None; images[i]: its ImageInputs
        (dgemma.images) or None. `verifier` (one for all prompts or a list, dgemma.generation.verify):
        search up to `max_rounds` rounds with `candidates` seeds per prompt; the winning candidate's
        request is returned (`request.search.stats()`: rounds, forwards, which candidate won)."""
        if verifier is not None:
            return self._generate_searches(prompts, sampling, seeds, templates, on_event, verifier, max_rounds,
                                           candidates, constraints, images)
        if max_rounds != 1 or candidates != 1:
            raise ValueError("max_rounds and candidates need a verifier")
        requests = []
        for i, prompt in enumerate(prompts):
            seed = _prompt_seed(seeds, sampling, i)
            fixed, tokens = (templates[i] if templates is not None else (None, None))
            constraint = constraints[i] if constraints is not None else None
            requests.append(Request(prompt=list(prompt), sampling=sampling, seed=seed, fixed=fixed,
                                    fixed_tokens=tokens, constraint=constraint, on_event=on_event,
                                    images=images[i] if images is not None else None))
        for r in requests:
            self._check_images(r)
        for r in requests:  # the engine's own queue bound does not apply to a direct batch call
            self.scheduler.add(r, bounded=False)
        self.run_until_done(requests)
        return requests

    def _generate_searches(self, prompts, sampling, seeds, templates, on_event, verifier, max_rounds, candidates,
                           constraints, images) -> list[Request]:
        if constraints is not None or images is not None:
            raise ValueError("Engine.generate's verifier search takes no constraints or images")
        checks = verifiers_for(verifier, len(prompts))
        searches = []
        for i, prompt in enumerate(prompts):
            seed = _prompt_seed(seeds, sampling, i)
            fixed, tokens = (templates[i] if templates is not None else (None, None))
            searches.append(Search.start(prompt, sampling, seed=seed, verifier=checks[i], max_rounds=max_rounds,
                                         candidates=candidates, fixed=fixed, fixed_tokens=tokens, on_event=on_event))
        requests = [r for s in searches for r in s.candidates]
        for r in requests:
            self.check_fits(r)
            self.scheduler.add(r, bounded=False)
        self.run_until_done(requests)
        return [s.winner for s in searches]

    def score(self, prompts: list[list[int]], top: int = 1) -> list[ScoreRequest]:
        """Convenience: score every prompt (`ScoreRequest.scores`), with `top` alternatives per position."""
        requests = [ScoreRequest(prompt=list(p), top=top) for p in prompts]
        for r in requests:
            self.scheduler.add(r, bounded=False)
        self.run_until_done(requests)
        return requests

    def warm_up(self):
        """Run throwaway requests so a compiled model compiles before real traffic: two prompt lengths
        and two batch sizes, after which dynamo keeps one dynamic-shape graph for every later shape."""
        sampling = SamplingConfig(max_new_tokens=self.canvas_length, max_denoising_steps=2, fixed_steps=True,
                                  eos_token_ids=(self.vocab_size,), pad_token_id=self.model.config.pad_token_id)
        for prompts in ([[0]], [[0, 0]], [[0]] * min(2, self.runner.max_batch)):
            self.generate(prompts, sampling, seeds=list(range(len(prompts))))
        self.forwards = self.decoder_positions = 0
        if self.prefix_cache is not None:  # its throwaway prompts are no one's prefix
            self.prefix_cache.clear(counters=True)

    # -- internals -------------------------------------------------------------------------------
    def _check_images(self, r: Request):
        """Images the prefill would refuse are refused now, on the caller's thread (in the loop they would
        fail every request in flight)."""
        images = r.state.images
        if images is None:
            return
        tower = self.model.vision_tower
        if tower is None:
            raise ValueError("this model has no vision tower: it does not read images")
        soft = int(tower.check(images.pixel_values, images.image_position_ids).sum())
        placeholders = sum(1 for t in r.prompt if t == self.model.config.image_token_id)
        if placeholders != soft:
            raise ValueError(f"the prompt holds {placeholders} image tokens for the {soft} soft tokens of its "
                             f"{len(images.pixel_values)} images (dgemma.images.expand_image_tokens)")

    def _start_canvas(self, r: Request):
        st, L, device = r.state, self.canvas_length, self.model.device
        fixed = fixed_tokens = None
        if st.fixed is not None:
            fixed, fixed_tokens = template_slice(st.fixed[None], st.fixed_tokens[None], st.canvas_index, L)  # (1, L)
            if fixed is not None:
                # sent from the host without waiting (the template is a host tensor)
                fixed = to_device(fixed.tolist(), torch.bool, device)
                fixed_tokens = to_device(fixed_tokens.tolist(), torch.long, device)
        st.soft = None
        st.denoising = CanvasDenoising(r.sampling, st.generator, 1, L, self.vocab_size, device, fixed=fixed,
                                       fixed_tokens=fixed_tokens, answers=None if st.answer is None else [st.answer],
                                       budget=columns_left(r.sampling.max_new_tokens, st.canvas_index, L))

    def _score_step(self):
        """One chunk of every scoring batch; a finished (or wholly cancelled) batch frees its rows."""
        for batch in list(self.scoring):
            if not batch.cancelled:
                batch.advance()
            if batch.done or batch.cancelled:
                self.scoring.remove(batch)
                self.scored_tokens += batch.encoded_tokens
                for r in batch.requests:
                    self._finish(r, "cancelled" if r.state.cancel_requested else "scored")

    def _denoise_step(self):
        """One decoder forward over every generating row, then each row's sampler step and stop rule
        (dgemma.generation.denoising, as the plain loop).

        The host learns what it schedules by from ONE read per step (`host_read`): each row's stop flag,
        how many of its positions take a sample, and what its canvas commits if it ends now (the argmax
        canvas, or for block refinement and DDIM the canvas itself).
        Everything else stays queued on the device; the bookkeeping (steps, budgets, rows) is Python.
        """
        batch = self.generating
        logits = self._step_logits(batch)  # per row (1, L, V): the sampler turns each into probabilities in place
        predicting = [r.state.denoising.predicting for r in batch]  # else a DDIM corrector sweep
        pending = [r.state.denoising.scan(logits[i], self.scan) for i, r in enumerate(batch)]
        table = torch.cat([torch.cat([p.stop.long()[:, None], p.drawn_count[:, None], p.candidate], 1)
                           for p in pending])
        read = host_read(table, "step")  # per row: [stop, drawn count, candidate canvas (L)]
        finished_canvases = []
        for i, (r, step, (stop, drawn, *candidate)) in enumerate(zip(batch, pending, read)):
            st = r.state
            denoising = st.denoising
            result = denoising.advance(step, [stop], drawn)
            st.argmax_tokens = candidate
            st.forward_passes += 1
            if denoising.finished and st.answer is not None:  # it commits the most probable valid canvas
                st.argmax_tokens = host_read(denoising.committed()[0], "constrained commit")
            if not denoising.finished and predicting[i]:
                # next step's self-conditioning: softmax of this step's temperature-scaled logits (the
                # sampler left it in the buffer), kept as an embedding so the buffer can go; a corrector
                # sweep's forward leaves the last predictor step's in place
                st.soft = self.runner.soft_embedding(logits[i][0])
            if r.want_drafts:  # streaming drafts reads them: more reads for such a request
                st.emit(self._draft_event(r, step, result))
            if denoising.finished:
                finished_canvases.append(r)
        del logits, pending
        if finished_canvases:
            self._commit(finished_canvases)

    def _draft_event(self, r: Request, pending, result) -> Event:
        """The "draft" event of a request's step: the argmax canvas, each position's entropy and whether it holds
        the model's prediction; where the sampler did so, the positions it edited or a corrector sweep redrew."""
        st = r.state
        marks = torch.stack([result.accepted[0],
                             result.edited[0] if result.edited is not None else torch.zeros_like(result.accepted[0]),
                             result.corrected[0] if result.corrected is not None
                             else torch.zeros_like(result.accepted[0])])
        accepted, edited, corrected = (list(map(bool, row)) for row in host_read(marks, "drafts"))
        tokens = st.argmax_tokens if st.denoising.sampler.commits_argmax else host_read(pending.draft[0], "drafts")
        cache = st.denoising.step_cache  # with the step cache, the positions this step kept: one more read
        settled = None if cache is None else list(map(bool, host_read(cache.kept[0], "drafts")))
        return Event("draft", r.request_id, st.canvas_index, step=st.denoising.step_index - 1, tokens=list(tokens),
                     entropy=host_read(result.entropy[0], "drafts"), accepted=accepted, edited=edited,
                     corrected=corrected, phase="predictor" if result.predictor else "corrector", settled=settled)

    def _step_logits(self, batch: list[Request]) -> list[torch.Tensor]:
        """Each generating row's logits (1, L, V): rows without the step cache from one forward over their canvases;
        rows with it from one packed forward over their active positions (dgemma.generation.step_cache)."""
        out, L, states = {}, self.canvas_length, [r.state for r in batch]
        whole = [i for i, st in enumerate(states) if st.denoising.step_cache is None]
        cached = [i for i, st in enumerate(states) if st.denoising.step_cache is not None]
        # every position active or not, packed: it writes the keys/values settled positions keep into the canvas slots
        packed = list(zip(cached, *active_counts([states[i].denoising.step_cache for i in cached],
                                                 [states[i].denoising.done for i in cached]))) if cached else []
        if whole:
            logits = self.runner.denoise([states[i].row for i in whole], torch.cat(
                [states[i].denoising.canvas for i in whole]), [states[i].soft for i in whole])  # (n, L, V)
            self.forwards += 1
            out.update({i: logits[j : j + 1] for j, i in enumerate(whole)})
        if packed:
            rows = [states[i] for i, _, _ in packed]

            def forward(active, row_counts, read):
                self.forwards += 1
                return self.runner.denoise_positions([st.row for st in rows], torch.cat(
                    [st.denoising.canvas for st in rows]), [st.soft for st in rows], active, row_counts, read)

            step_logits = packed_step([st.denoising.step_cache for st in rows], [st.denoising.canvas for st in rows],
                                      [active for _, active, _ in packed], [c for _, _, c in packed], forward)
            out.update({i: logits for (i, _, _), logits in zip(packed, step_logits)})  # one row a request
        ran = dict.fromkeys(range(len(batch)), L) | {i: count for i, _, count in packed}
        for i, st in enumerate(states):
            st.decoder_positions += ran[i]
            st.whole_canvas_positions += L
        self.decoder_positions += sum(ran.values())
        return [out[i] for i in range(len(batch))]

    def _commit(self, requests: list[Request]):
        """Commit finished canvases, from their argmax tokens already on the host (no read here)."""
        continuing_rows, continuing_canvases, continuing = [], [], []
        for r in requests:
            s, st = r.sampling, r.state
            canvas_tokens = pad_after_eos_host(st.argmax_tokens, s.eos_token_ids, s.pad_token_id)  # L tokens
            st.committed_non_pad += sum(t != s.pad_token_id for t in canvas_tokens)
            st.steps_per_canvas.append(st.denoising.step_index)
            budget = columns_left(s.max_new_tokens, st.canvas_index, self.canvas_length)
            new, hit_eos = cut_at_eos(canvas_tokens[:budget], s.eos_token_ids)
            st.tokens.extend(new)
            if st.t_first_canvas is None:
                st.t_first_canvas = time.perf_counter()
            st.emit(Event("canvas", r.request_id, st.canvas_index, tokens=new))
            if hit_eos or budget <= self.canvas_length:
                if r.cache_answer and self.prefix_cache is not None and r.verifier is None:
                    self.runner.commit([st.row], [canvas_tokens[: len(new) + hit_eos]])
                if not self._verify(r):
                    self._finish(r, "stop" if hit_eos else "length")
                continue
            continuing_rows.append(st.row)
            continuing_canvases.append(canvas_tokens)
            continuing.append(r)
        if continuing:
            self.runner.commit(continuing_rows, continuing_canvases)
            for r in continuing:
                r.state.canvas_index += 1
                self._start_canvas(r)

    def _verify(self, r: Request) -> bool:
        """A complete output meets the request's verifier: True when a new round starts (the verifier
        rejected positions and rounds are left), False when the request finishes."""
        if r.verifier is None:
            return False
        st = r.state
        st.rejected = rejected_positions(r.verifier, st.tokens)
        st.verdict = not st.rejected
        if st.verdict or st.round >= r.max_rounds:
            return False
        st.fixed, st.fixed_tokens = next_template(r.fixed, r.fixed_tokens, st.tokens, st.rejected)
        st.round += 1
        st.verdict = None
        st.emit(Event("round", r.request_id, st.canvas_index, step=st.round, tokens=list(st.rejected)))
        st.tokens, st.canvas_index = [], 0
        if st.prefilled != len(r.prompt) or self.runner.cache.row_lengths[st.row] != len(r.prompt):
            # the row holds committed canvases: start again from the prompt alone (the next steps prefill it)
            self.runner.free([st.row])
            st.prefilled, st.denoising = None, None
        else:
            self._start_canvas(r)
        return True

    def _finish(self, r: Request | ScoreRequest, reason: str):
        st = r.state
        st.finish_reason = reason
        st.status = Status.CANCELLED if reason == "cancelled" else Status.FINISHED
        st.t_done = time.perf_counter()
        if not r.scoring:
            st.soft = st.denoising = st.answer = st.argmax_tokens = None
        row = self.scheduler.release(r)
        if row is not None:
            self.runner.free([row])
        st.emit(Event("finished", r.request_id, st.canvas_index if not r.scoring else 0, finish_reason=reason))
