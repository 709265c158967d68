"""A supervised fine-tuning script for `bench doctor`, shaped as Minimind's trainer/train_full_sft.py:
a tokenizer loaded with transformers from a model folder; its SFTDataset over a chat JSONL (per
sample the chat template rendered, tokenized, the assistant's turns found in the token ids for
the labels, the row padded to max_length), the file's path kept nowhere in the dataset (Minimind
hands it to Hugging Face datasets), only in argv; batches from a batch_sampler; a tiny model's
step, so that it waits for data. It imports nothing of mmpack.

    python tests/tools/doctor_chat.py --data_path SFT.jsonl --tokenizer_path MODEL_DIR [--batch_size 8]
"""

import argparse
import json

import torch
from transformers import AutoTokenizer


class SFTDataset(torch.utils.data.Dataset):
    def __init__(self, jsonl_path, tokenizer, max_length=512):
        with open(jsonl_path, encoding="utf-8") as f:
            self.samples = [json.loads(line)["conversations"] for line in f if line.strip()]
        self.tokenizer, self.max_length = tokenizer, max_length
        self.bos_id = tokenizer(f"{tokenizer.bos_token}assistant\n", add_special_tokens=False).input_ids
        self.eos_id = tokenizer(f"{tokenizer.eos_token}\n", add_special_tokens=False).input_ids

    def __len__(self):
        return len(self.samples)

    def labels(self, ids):
        labels, i, b, e = [-100] * len(ids), 0, self.bos_id, self.eos_id
        while i < len(ids):
            if ids[i:i + len(b)] != b:
                i += 1
                continue
            end = i + len(b)
            while end < len(ids) and ids[end:end + len(e)] != e:
                end += 1
            labels[i + len(b):min(end + len(e), self.max_length)] = ids[i + len(b):min(end + len(e), self.max_length)]
            i = end + len(e)
        return labels

    def __getitem__(self, index):
        prompt = self.tokenizer.apply_chat_template(self.samples[index], tokenize=False, add_generation_prompt=False)
        ids = self.tokenizer(prompt).input_ids[:self.max_length]
        ids += [self.tokenizer.pad_token_id] * (self.max_length - len(ids))
        return torch.tensor(ids, dtype=torch.long), torch.tensor(self.labels(ids), dtype=torch.long)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_path", required=True)
    ap.add_argument("--tokenizer_path", required=True)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--max_seq_len", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)  # a step of a few ms that a busy machine's thread scheduling does not stretch past the data's
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
    ds = SFTDataset(args.data_path, tokenizer, args.max_seq_len)
    batches = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(ds), args.batch_size, drop_last=False)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=batches, num_workers=0)  # as Minimind's trainer makes it
    embed, head = torch.nn.Embedding(len(tokenizer), 8), torch.nn.Linear(8, len(tokenizer))
    opt = torch.optim.SGD([*embed.parameters(), *head.parameters()], lr=0.1)
    for epoch in range(2):
        for x, y in loader:
            target = y[:, 1:]
            trained = target != -100  # the logits of 64 trained tokens alone: a step far shorter than the data's
            loss = torch.nn.functional.cross_entropy(head(embed(x[:, :-1])[trained][:64]), target[trained][:64])
            loss.backward()
            opt.step()
            opt.zero_grad()
    print("trained")
