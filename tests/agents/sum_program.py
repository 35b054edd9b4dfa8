"""A separate agent program: any language would do; it only needs the base URL. Given the task as JSON in argv[1],
it asks for a+b over two chat turns with the official client (which reads OPENAI_BASE_URL and OPENAI_API_KEY)
and prints its reward as the last line of stdout."""
import json
import os
import sys

import openai

task = json.loads(sys.argv[1])
client = openai.OpenAI(max_retries=0)  # base_url and api_key from the environment
msgs = [{"role": "user", "content": f"{task['a']}+{task['b']}="}]
for _ in range(2):
    reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=msgs, max_tokens=8)
    msgs += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
print(float(str(task["a"] + task["b"]) in (reply.choices[0].message.content or "")))
