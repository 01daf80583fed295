"""The text generation server through the official openai client (run by
tests/functional/text_generation_server_openai_test.cpp against its server): /v1/models,
completions (plain, echo + logprobs), chat (plain, streamed with usage, logprobs), a 400 as
openai.BadRequestError, and Megatron's tools/text_generation_cli.py error handling on /api.
--probe only checks that the openai package imports."""
import argparse
import json
import sys
import urllib.error
import urllib.request

parser = argparse.ArgumentParser()
parser.add_argument("--probe", action="store_true")
parser.add_argument("--base-url")
parser.add_argument("--model")
args = parser.parse_args()

import openai  # noqa: E402

if args.probe:
    sys.exit(0)

client = openai.OpenAI(base_url=args.base_url, api_key="unused")

ids = [m.id for m in client.models.list().data]
assert ids == [args.model], ids

c = client.completions.create(model=args.model, prompt="u:hi\na:", max_tokens=8, temperature=0, logprobs=1)
assert c.object == "text_completion", c
choice = c.choices[0]
assert choice.finish_reason in ("stop", "length"), choice
assert len(choice.logprobs.tokens) == c.usage.completion_tokens or choice.finish_reason == "stop", c
assert "".join(choice.logprobs.tokens) == choice.text, choice

e = client.completions.create(model=args.model, prompt="The cat", max_tokens=0, echo=True, logprobs=1, temperature=0)
lp = e.choices[0].logprobs
assert e.choices[0].text == "The cat", e
assert lp.token_logprobs[0] is None and all(x < 0 for x in lp.token_logprobs[1:]), lp
assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:]), lp

messages = [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}]
chat = client.chat.completions.create(model=args.model, messages=messages, max_tokens=10, temperature=0)
assert chat.object == "chat.completion", chat
text = chat.choices[0].message.content
assert chat.choices[0].message.role == "assistant", chat
plain = client.completions.create(model=args.model, prompt="system:be\nuser:hi\nassistant:", max_tokens=10, temperature=0)
assert plain.choices[0].text == text, (plain, chat)

stream = client.chat.completions.create(model=args.model, messages=messages, max_tokens=10, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
pieces, usage = [], None
for chunk in stream:
    if chunk.choices:
        pieces.append(chunk.choices[0].delta.content or "")
    if chunk.usage is not None:
        usage = chunk.usage
assert "".join(pieces) == text, (pieces, text)
assert usage is not None and usage.total_tokens == chat.usage.total_tokens, (usage, chat.usage)

withlp = client.chat.completions.create(model=args.model, messages=messages, max_tokens=4, temperature=0,
                                        logprobs=True, top_logprobs=2)
content = withlp.choices[0].logprobs.content
assert len(content) >= 1 and all(len(t.top_logprobs) == 2 for t in content), withlp
assert abs(content[0].top_logprobs[0].logprob - content[0].logprob) < 1e-9, content[0]  # greedy

try:
    client.completions.create(model=args.model, prompt="x", suffix="y", max_tokens=1)
    raise AssertionError("suffix was accepted")
except openai.BadRequestError as err:
    assert "fill-in-the-middle" in err.message, err.message

# Megatron's tools/text_generation_cli.py: `if response.status_code != 200: print(f"Error
# {response.status_code}: {response.json()['message']}")`; its lines, with urllib for requests.
url = args.base_url[: -len("/v1")] + "/api"
request = urllib.request.Request(url, data=json.dumps({"prompts": "hi", "tokens_to_generate": 4}).encode(),
                                 headers={"Content-Type": "application/json"}, method="PUT")
try:
    urllib.request.urlopen(request)
    raise AssertionError("a bad /api request was accepted")
except urllib.error.HTTPError as response:
    assert response.code == 400
    line = f"Error {response.code}: {json.loads(response.read())['message']}"
    assert line == "Error 400: prompts is not a list of strings", line
print("openai client: models, completions, echo logprobs, chat (plain, streamed, logprobs), errors: ok")
