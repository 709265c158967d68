"""`bench loaders --chat`: supervised fine-tuning data as Minimind trains on it today (a Dataset
that renders each conversation with the chat template, tokenizes it, searches its tokens for the
assistant's turns to make the labels and pads it, in DataLoader workers) against the same
conversations packed once and read by `Loader(PackedDocuments(out, seq_len))`: trained tokens
(labels != -100) per second, the share of each batch that is padding, CPU seconds per million
trained tokens; the build's one-time cost apart. Real data: Shakespeare's dialogues as
Minimind's chat JSONL (`bench.dialogue`), a BPE trained on them, Minimind's own chat template,
max_length 512 (Minimind's sft_mini_512).

The run checks that both readers train the same tokens of a conversation, and says where
their masks differ: Minimind's starts after `<|im_start|>assistant\\n`, ours after the
template's whole generation prompt.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import tempfile
from collections import Counter
from pathlib import Path

import torch

from . import report
from .loaders_bench import PIN, _progress, machine
from .prepare import prepare_dataset
from .measure import MachineLoad, _one_pass, load_line, measure
from .peers import MP_CONTEXT

MAX_LENGTH = 512  # Minimind's sft_mini_512
IGNORE = -100
MINIMIND_AT = "jingyaogong/minimind@d65ef2c00ebc dataset/lm_dataset.py"
QUICK_CONVERSATIONS = 600
ROUNDS = 5  # alternated rounds of a pass of each row, for the ratios
PACKED_EPOCHS = 32


class MinimindStyleSFT(torch.utils.data.Dataset):
    """Our equivalent of Minimind's SFTDataset (MINIMIND_AT), written anew: per item,
    `apply_chat_template(tokenize=False)`, the tokenizer's ids cut at max_length and (`pad`)
    padded to it with the pad token, then labels by a search of the ids: after each
    `bos_token + "assistant\\n"`, every token through the next `eos_token + "\\n"`, -100
    elsewhere. Items are (input_ids, labels) as Minimind's are. Left out: its two random
    augmentations (a system prompt added to 20% of conversations, the empty <think> block taken
    out of 80%), so that it reads the conversations the packed build read; and its Hugging Face
    `datasets` table (the JSONL is read into a list: a cost it no longer has)."""

    def __init__(self, jsonl: Path, tokenizer, max_length: int = MAX_LENGTH, *, pad: bool = True):
        with open(jsonl, encoding="utf-8") as f:
            self.conversations = [json.loads(line)["conversations"] for line in f if line.strip()]
        self.tokenizer, self.max_length, self.pad = tokenizer, max_length, pad
        self.start = tokenizer(f"{tokenizer.bos_token}assistant\n", add_special_tokens=False).input_ids
        self.end = tokenizer(f"{tokenizer.eos_token}\n", add_special_tokens=False).input_ids

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        text = self.tokenizer.apply_chat_template(self.conversations[i], tokenize=False, add_generation_prompt=False)
        ids = self.tokenizer(text).input_ids[:self.max_length]
        if self.pad:
            ids += [self.tokenizer.pad_token_id] * (self.max_length - len(ids))
        return torch.tensor(ids, dtype=torch.long), torch.tensor(self.labels(ids), dtype=torch.long)

    def labels(self, ids: list[int]) -> list[int]:
        """Minimind's mask search, token by token as it runs (its cost is part of the baseline)."""
        labels, start, end = [IGNORE] * len(ids), self.start, self.end
        i = 0
        while i < len(ids):
            if ids[i:i + len(start)] != start:
                i += 1
                continue
            first = stop = i + len(start)
            while stop < len(ids) and ids[stop:stop + len(end)] != end:
                stop += 1
            for j in range(first, min(stop + len(end), self.max_length)):
                labels[j] = ids[j]
            i = stop + len(end) if stop < len(ids) else len(ids)
        return labels


class PadToLongest:
    """A collator's dynamic padding: each batch's (input_ids, labels) padded to its longest,
    with the pad token and -100."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, labels = zip(*items)
        pad = torch.nn.utils.rnn.pad_sequence
        return pad(list(ids), batch_first=True, padding_value=self.pad_id), \
            pad(list(labels), batch_first=True, padding_value=IGNORE)


def model_folder(folder: Path) -> Path:
    """A model's tokenizer folder as the Hub has one: the chat tokenizer's tokenizer.json and a
    tokenizer_config.json with Minimind's chat template and special tokens."""
    from .chat_templates import MINIMIND, MINIMIND_SPECIAL
    from .dialogue import chat_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes(chat_tokenizer().read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": MINIMIND, **MINIMIND_SPECIAL}))
    return folder


class Tally:
    """What a row's batches held, over every pass: trained tokens (the rate's unit), the
    batches' tokens, their padding, and conversations (not counted in packed rows, where a long
    one is in pieces)."""

    def __init__(self, pad_id: int | None = None):
        self.pad_id, self.trained, self.tokens, self.padding, self.conversations = pad_id, 0, 0, 0, 0

    def __call__(self, batch) -> int:
        if isinstance(batch, dict):  # PackedDocuments: `lengths` real tokens a row, a segment a piece
            lengths, tokens = batch["lengths"], batch["tokens"]
            labels, padding, conversations = batch["labels"], tokens.numel() - int(lengths.sum()), 0
        else:
            tokens, labels = batch
            padding, conversations = int((tokens == self.pad_id).sum()), len(tokens)
        trained = int((labels != IGNORE).sum())
        self.trained += trained
        self.tokens += tokens.numel()
        self.padding += padding
        self.conversations += conversations
        return trained

    def figures(self) -> dict:
        return {"padding_share": self.padding / max(self.tokens, 1),
                "trained_per_conversation": self.trained / self.conversations if self.conversations else None}


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    runs, start = [], None
    for i, f in enumerate([*flags, False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            runs.append((start, i))
            start = None
    return runs


def check_masks(out: Path, sft: MinimindStyleSFT, count: int) -> dict:
    """The first `count` conversations that fit in max_length: the baseline's tokens and labels
    against the packed build's tokens and loss mask; where the masks differ, how many tokens an
    assistant turn and the text most often in the difference. And whether one epoch of
    PackedDocuments labels exactly the tokens the build masked."""
    from loaders import Loader, MMapDataset, PackedDocuments

    ds = MMapDataset(out, columns=["tokens", "loss_mask", "key"])
    c = Counter()
    texts: Counter = Counter()
    masked = 0
    for i in range(len(ds)):
        s = ds[i]
        masked += int(s["loss_mask"].sum())
        if len(s["tokens"]) > sft.max_length or c["conversations"] >= count:
            continue
        line = int(s["key"].rsplit(":", 1)[1]) - 1  # a JSONL key is file:line, 1-based
        ids, labels = (t.tolist() for t in sft[line])
        ids, labels = ids[:len(s["tokens"])], labels[:len(s["tokens"])]  # the padding aside
        ours, theirs = s["loss_mask"].bool().tolist(), [v != IGNORE for v in labels]
        extra = [a and not b for a, b in zip(theirs, ours)]
        c.update(conversations=1, same_tokens=ids == s["tokens"].tolist(), same_mask=ours == theirs,
                 turns=sum(m["role"] == "assistant" for m in sft.conversations[line]), extra=sum(extra),
                 missing=sum(b and not a for a, b in zip(theirs, ours)))
        texts.update(sft.tokenizer.decode(ids[a:b]) for a, b in _runs(extra))
    with Loader(PackedDocuments(out, sft.max_length), 64, seed=0, num_threads=1) as loader:
        labelled = sum(int((b["labels"] != IGNORE).sum()) for b in loader)
    text, times = texts.most_common(1)[0] if texts else (None, 0)
    return {"conversations": c["conversations"], "same_tokens": c["same_tokens"], "same_mask": c["same_mask"],
            "turns": c["turns"], "baseline_only_tokens": c["extra"], "packed_only_tokens": c["missing"],
            "baseline_only_per_turn": c["extra"] / max(c["turns"], 1), "baseline_only_text": text,
            "baseline_only_text_times": times, "packed_epoch_labels": labelled, "build_masked_tokens": masked}


def bench_chat(args) -> dict:
    from transformers import AutoTokenizer

    from loaders import Loader, PackedDocuments

    from .dialogue import write_minimind

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as Minimind sets it: its workers fork
    load = MachineLoad()
    work = Path(args.work or tempfile.mkdtemp(prefix="mmpack-bench-"))
    count = min(args.conversations, QUICK_CONVERSATIONS) if args.quick else args.conversations
    model = model_folder(work / "model-minimind")
    raw, out, build_s = prepare_dataset(work, "chat", count, lambda r: write_minimind(r / "sft.jsonl", count, seed=0),
                                        {"tokenizer": model / "tokenizer.json",
                                         "chat_template": model / "tokenizer_config.json"})
    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    bs, workers, results = args.chat, args.workers, []
    masks = check_masks(out, MinimindStyleSFT(raw / "sft.jsonl", tok, pad=False), 200)

    def run(name, family, make_iter, tally, threads, per_conversation=None):
        r = {"system": name, "family": family, "kind": "chat", "threads": threads}
        try:
            r.update(measure(make_iter, tally, passes=args.passes))
            r["trained_tokens_per_s"] = r.pop("samples_per_s")
            r["cpu_s_per_m_trained"] = 1000 * r.pop("cpu_s_per_1000")
            r.update(tally.figures())
            r["trained_per_conversation"] = r["trained_per_conversation"] or per_conversation
            r["conversations_per_s"] = r["trained_tokens_per_s"] / max(r["trained_per_conversation"], 1e-9)
        except Exception as exc:  # noqa: BLE001 - a system that breaks is a row with its error
            r["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        r["samples_per_s"] = r.get("trained_tokens_per_s")  # the plot's and _progress's figure
        results.append(r)
        _progress(r)

    passes_of = {}  # each row's pass, again in the alternated rounds
    dataloaders = []
    for pad, how in ((True, f"pad to max_length {MAX_LENGTH}"), (False, "pad to batch's longest")):
        sft = MinimindStyleSFT(raw / "sft.jsonl", tok, pad=pad)
        dataloaders.append(torch.utils.data.DataLoader(
            sft, batch_size=bs, shuffle=True, num_workers=workers, collate_fn=None if pad else PadToLongest(
                tok.pad_token_id), pin_memory=PIN, persistent_workers=workers > 0,
            multiprocessing_context=MP_CONTEXT if workers else None))
        name = f"Minimind-style Dataset, {how}, DataLoader {workers} workers"
        passes_of[name] = lambda dl=dataloaders[-1]: dl
        run(name, "baseline", passes_of[name], Tally(tok.pad_token_id), max(workers, 1))
    packed = PackedDocuments(out, MAX_LENGTH)
    # a pass of PACKED_EPOCHS epochs (256 batches at least): long enough against this shared machine's
    # hiccups (an epoch takes milliseconds, the baseline's seconds)
    epochs = max(PACKED_EPOCHS, -(-256 * bs // len(packed)))
    with Loader(packed, bs, seed=0) as loader:
        name = f"mmpack Loader(PackedDocuments(out, {MAX_LENGTH})), {loader.num_threads} thread(s)"
        passes_of[name] = lambda: itertools.chain.from_iterable(loader for _ in range(epochs))
        run(name, "mmpack", passes_of[name], Tally(), loader.num_threads, masks["build_masked_tokens"] / count)
        rounds = alternated(passes_of, tok.pad_token_id, 2 if args.quick else ROUNDS)
    del dataloaders  # their persistent workers end with them
    return {"command": f"bench loaders --chat {bs}" + (" --quick" if args.quick else ""), "kind": "chat",
            "machine": machine(), "load": load.report(), "batch_size": bs, "workers": workers,
            "max_length": MAX_LENGTH, "num_conversations": count, "build_s": build_s,
            "num_rows": len(packed), "build_padding_share": packed.padding_fraction,
            "mask_check": masks,
            "results": results, "rounds": rounds, "summary": _summary(results, rounds), "baseline": MINIMIND_AT}


def alternated(passes_of: dict, pad_id: int, rounds: int) -> dict[str, list[float]]:
    """Each row's trained tokens/s in `rounds` rounds, a pass of every row in each, one right
    after another: the shared machine's load moves them alike, where rows measured a minute
    apart differ by more than the gap between two baselines (the ratios' source)."""
    rates: dict[str, list[float]] = {name: [] for name in passes_of}
    for _ in range(rounds):
        for name, make_iter in passes_of.items():
            trained, seconds, _ = _one_pass(make_iter, Tally(pad_id), None)
            rates[name].append(trained / seconds)
    return rates


def _summary(results: list[dict], rounds: dict[str, list[float]]) -> dict | None:
    """The packed row against each baseline, as the median (and range) of the alternated rounds'
    ratios; and the issue's targets: >= 50x the trained tokens/s of the Minimind-style Dataset
    padded to max_length, under 5% padding where padding to the batch's longest gives 40% or more."""
    rated = [r for r in results if "trained_tokens_per_s" in r]
    packed = next((r for r in rated if r["family"] == "mmpack"), None)
    fixed, longest = (next((r for r in rated if r["family"] == "baseline" and word in r["system"]), None)
                      for word in ("max_length", "longest"))
    if not (packed and fixed and longest):
        return None

    def ratios(base: dict) -> list[float]:
        return sorted(p / b for p, b in zip(rounds[packed["system"]], rounds[base["system"]]))
    x, x_longest = ratios(fixed), ratios(longest)
    whole = fixed["trained_per_conversation"] / packed["trained_per_conversation"]  # a conversation's labels: theirs / ours
    return {"x_max_length": statistics.median(x), "x_max_length_range": [x[0], x[-1]],
            "x_conversations": statistics.median(x) * whole, "x_conversations_range": [x[0] * whole, x[-1] * whole],
            "trained_per_conversation": [fixed["trained_per_conversation"], packed["trained_per_conversation"]],
            "x_longest": statistics.median(x_longest), "x_longest_range": [x_longest[0], x_longest[-1]],
            "rounds": len(x), "target_x": 50, "cpu_x_max_length": fixed["cpu_s_per_m_trained"] / max(
                packed["cpu_s_per_m_trained"], 1e-9), "padding_packed": packed["padding_share"],
            "padding_longest": longest["padding_share"], "padding_max_length": fixed["padding_share"],
            "met": statistics.median(x) >= 50 and packed["padding_share"] < 0.05 and longest["padding_share"] >= 0.4}


def chat_table(rep: dict) -> str:
    f = report._f
    lines = [f"{rep['num_conversations']:,} conversations (Shakespeare's dialogues as Minimind's chat JSONL, Minimind's "
             f"chat template, a 2,000-id BPE), batch {rep['batch_size']}, max_length {rep['max_length']}; packed: "
             f"{rep['num_rows']:,} rows of {rep['max_length']} tokens",
             f"{'system':74} {'trained tok/s':>13} {'conv/s':>8} {'padding':>7} {'CPUs/M':>7} {'x base':>7} "
             f"{'1st s':>6} {'RSS MB':>7}"]
    base = next((r["trained_tokens_per_s"] for r in rep["results"] if r["family"] == "baseline"
                 and "trained_tokens_per_s" in r), None)
    for r in rep["results"]:
        if "error" in r:
            lines.append(f"{r['system'][:74]:74} error: {r['error']}")
            continue
        lines.append(f"{r['system'][:74]:74} {r['trained_tokens_per_s']:>13,.0f} {r['conversations_per_s']:>8,.0f} "
                     f"{100 * r['padding_share']:>6.1f}% {r['cpu_s_per_m_trained']:>7.1f} "
                     f"{f(base and r['trained_tokens_per_s'] / base, '>7.1f')} {r['first_batch_s']:>6.2f} "
                     f"{r['peak_rss_mb']:>7,.0f}")
    s = rep["summary"]
    if s:
        lines.append(f"packed vs the Minimind-style Dataset, median of {s['rounds']} rounds alternating the rows: "
                     f"{s['x_max_length']:,.1f}x ({s['x_max_length_range'][0]:,.1f}-{s['x_max_length_range'][1]:,.1f}) "
                     f"the trained tokens/s padded to max_length (target >= {s['target_x']}x), {s['x_longest']:,.1f}x "
                     f"({s['x_longest_range'][0]:,.1f}-{s['x_longest_range'][1]:,.1f}) padded to the batch's longest; "
                     f"padding {100 * s['padding_packed']:.1f}% packed (target < 5%) against "
                     f"{100 * s['padding_longest']:.0f}% to the batch's longest (>= 40%) and "
                     f"{100 * s['padding_max_length']:.0f}% to max_length: {'met' if s['met'] else 'NOT met'}; "
                     f"CPU seconds a trained token: the Minimind-style Dataset (max_length) {s['cpu_x_max_length']:,.0f}x "
                     "the packed reader's (a figure other load on the machine moves less than a rate); in conversations "
                     f"a second, {s['x_conversations']:,.1f}x ({s['x_conversations_range'][0]:,.1f}-"
                     f"{s['x_conversations_range'][1]:,.1f}): Minimind's labels count "
                     f"{s['trained_per_conversation'][0]:.1f} tokens a conversation (cut at max_length), ours "
                     f"{s['trained_per_conversation'][1]:.1f} (whole)")
    lines += _mask_lines(rep["mask_check"])
    lines.append(f"one-time cost, in no rate: packer build {rep['build_s']:.1f} s for the {rep['num_conversations']:,} "
                 "conversations (template, tokenizer and masks, once)")
    lines.append("trained tok/s: labels != -100 per second (each reader's own labels); conv/s: conversations a second "
                 "(packed: its trained tokens over the build's per conversation); padding: the share of the batches' tokens that is padding; CPUs/M: CPU seconds "
                 f"per million trained tokens, DataLoader workers included; x base: vs the first row, as measured (each row "
                 f"its own moment; the ratios below alternate them); baseline: "
                 f"{rep['baseline']}, its workers kept between epochs (their start-up not timed)")
    if load_line(rep.get("load")):
        lines.append(load_line(rep["load"]))
    return "\n".join(lines)


def _mask_lines(c: dict) -> list[str]:
    """The mask check said: identical, or by how many tokens a turn and which text they differ."""
    same = (f"same trained tokens: {c['conversations']} conversations that fit in max_length: tokens identical in "
            f"{c['same_tokens']}, masks identical in {c['same_mask']}")
    if c["same_mask"] < c["conversations"]:
        same += (f"; the masks differ: Minimind's search labels {c['baseline_only_tokens']:,} tokens ours does not "
                 f"({c['baseline_only_per_turn']:.1f} an assistant turn, most often {c['baseline_only_text']!r}, "
                 f"{c['baseline_only_text_times']:,} times: it starts after '<|im_start|>assistant\\n', ours after "
                 f"the template's whole generation prompt), and ours {c['packed_only_tokens']:,} it does not")
    lost = c["packed_epoch_labels"] - c["build_masked_tokens"]
    return [same, f"an epoch of PackedDocuments labels {c['packed_epoch_labels']:,} tokens, the build masked "
                  f"{c['build_masked_tokens']:,}: " + ("the same" if lost == 0 else f"DIFFERENT by {lost:,}")]


def plot_chat(rep: dict, path: Path) -> None:
    """Trained tokens/s (log scale) and the batches' padding share, a bar a row."""
    plt = report._plt()
    rows = [r for r in rep["results"] if "trained_tokens_per_s" in r][::-1]
    names = [r["system"].replace(", DataLoader", ",\nDataLoader") for r in rows]
    colors = ["tab:blue" if r["family"] == "mmpack" else "tab:red" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 1.1 * len(rows) + 1.6), sharey=True,
                               gridspec_kw={"width_ratios": [3, 2]})
    rates, pads = [r["trained_tokens_per_s"] for r in rows], [100 * r["padding_share"] for r in rows]
    a.barh(names, rates, color=colors)
    a.set_xscale("log")
    a.set_xlim(min(rates) / 4, max(rates) * 6)  # room for each bar's figure
    a.set_xlabel("trained tokens/s (labels != -100; log scale)")
    b.barh(names, pads, color=colors)
    b.set_xlabel("% of each batch's tokens that is padding")
    for ax, values, fmt in ((a, rates, "{:,.0f}"), (b, pads, "{:.1f}%")):
        for y, v in enumerate(values):
            ax.text(v, y, " " + fmt.format(v), va="center", fontsize=8)
    fig.suptitle(f"{rep['command']} on {rep['machine']['cores']} cores: {rep['num_conversations']:,} conversations, "
                 f"batch {rep['batch_size']}, max_length {rep['max_length']}" + _ratio_line(rep.get("summary")),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ratio_line(s: dict | None) -> str:
    """The plot's second title line: the ratio the run stands by (the rows' bars are each its own moment)."""
    return (f"\npacked / Minimind-style (max_length): {s['x_max_length']:,.1f}x the trained tokens/s, median of "
            f"{s['rounds']} rounds alternating the rows") if s else ""
