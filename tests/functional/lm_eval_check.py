"""lm-eval-harness's local-completions model against the text generation server (run by
tests/functional/text_generation_server_openai_test.cpp): a tiny multiple-choice task written here
is scored by lm_eval through /v1/completions (echo + logprobs), and the same choices are scored
through the server's Megatron /api prompt logprobs; every loglikelihood and the accuracy must agree.
--probe only checks that lm_eval imports."""
import argparse
import json
import os
import sys
import urllib.request

parser = argparse.ArgumentParser()
parser.add_argument("--probe", action="store_true")
parser.add_argument("--base-url")
parser.add_argument("--model")
parser.add_argument("--tokenizer")
parser.add_argument("--workdir")
args = parser.parse_args()

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import lm_eval  # noqa: E402
import tenacity  # noqa: E402,F401  (lm_eval[api]: what local-completions needs)
import aiohttp  # noqa: E402,F401
import transformers  # noqa: E402,F401

if args.probe:
    sys.exit(0)

from lm_eval.tasks import TaskManager  # noqa: E402

docs = [  # lm-eval puts its target_delimiter " " between question and choice
    {"question": "Q: 2+2=", "choices": ["4", "5", "22"], "answer": 0},
    {"question": "Q: sky is", "choices": ["blue", "green"], "answer": 0},
    {"question": "Q: cats say", "choices": ["woof", "meow", "moo"], "answer": 1},
    {"question": "Q: a b c", "choices": ["d", "e"], "answer": 0},
    {"question": "Q: up or", "choices": ["down", "left", "in"], "answer": 2},
    {"question": "Hi:", "choices": ["yes", "no"], "answer": 1},
]
os.makedirs(args.workdir, exist_ok=True)
data = os.path.join(args.workdir, "tiny_mc.jsonl")
with open(data, "w") as f:
    for d in docs:
        f.write(json.dumps(d) + "\n")
with open(os.path.join(args.workdir, "tiny_mc.yaml"), "w") as f:
    f.write(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")

results = lm_eval.simple_evaluate(
    model="local-completions",
    model_args=(f"model={args.model},base_url={args.base_url}/v1/completions,tokenizer={args.tokenizer},"
                "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"),
    tasks=["tiny_mc"], task_manager=TaskManager(include_path=args.workdir), log_samples=True)
acc = results["results"]["tiny_mc"]["acc,none"]


def api_prompt_logprobs(prompt):
    body = {"prompts": [prompt], "tokens_to_generate": 0, "logprobs": True, "no_log": True}
    request = urllib.request.Request(args.base_url + "/api", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="PUT")
    return json.loads(urllib.request.urlopen(request).read())["logprobs"][0]


# Our own scores: each (context, continuation) lm-eval asked about, scored by the continuation's
# log-probabilities from /api (one byte a token, so the continuation is the last len(bytes)
# tokens); the answer is the choice with the highest sum.
samples = sorted(results["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
assert len(samples) == len(docs), samples
correct = 0
for doc, sample in zip(docs, samples):
    ours = []
    for context, continuation in sample["arguments"]:
        assert continuation == " " + doc["choices"][len(ours)], (continuation, doc)
        lps = api_prompt_logprobs(context + continuation)
        ours.append(sum(lps[-len(continuation.encode()):]))
    theirs = [r[0][0] for r in sample["resps"]]
    assert len(theirs) == len(ours), (theirs, ours)
    for a, b in zip(theirs, ours):
        if abs(a - b) >= 1e-6:
            tok = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
            whole = doc["question"] + doc["choices"][0]
            body = {"prompt": whole, "echo": True, "logprobs": 0, "max_tokens": 0}
            request = urllib.request.Request(args.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            echoed = json.loads(urllib.request.urlopen(request).read())["choices"][0]["logprobs"]["tokens"]
            raise AssertionError(f"{doc}: lm-eval {theirs} vs ours {ours}; transformers ids {tok(whole).input_ids}, "
                                 f"our tokens {echoed}, lm-eval's first request {sample['arguments'][0]}")
    correct += int(max(range(len(ours)), key=lambda i: ours[i]) == doc["answer"])
assert abs(acc - correct / len(docs)) < 1e-12, (acc, correct)
print(f"lm-eval local-completions: acc {acc:.4f} over {len(docs)} questions, equal to our own /api scores")
