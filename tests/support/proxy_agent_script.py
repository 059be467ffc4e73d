"""An agent in another process (run by ProxyAgentWorkflow): plain openai client code configured only
by OPENAI_BASE_URL / OPENAI_API_KEY; it reports its reward to the proxy over HTTP."""

import json
import os

import httpx
import openai
from agent_helpers import ADD_TOOL, question

task = json.loads(os.environ["AREAL_TASK"])
client = openai.OpenAI(max_retries=0)  # base URL and key from the environment
msgs = question(task["a"], task["b"])
r = client.chat.completions.create(model="policy", messages=msgs, tools=[ADD_TOOL], max_tokens=80,
                                   temperature=0)
m = r.choices[0].message
reward = 0.0
if m.tool_calls:
    msgs.append(m.model_dump(exclude_none=True))
    for call in m.tool_calls:
        args = json.loads(call.function.arguments)
        result = str(args.get("a", 0) + args.get("b", 0))
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": result})
    r2 = client.chat.completions.create(model="policy", messages=msgs, tools=[ADD_TOOL], max_tokens=30,
                                        temperature=0)
    reward = 1.0 if str(task["a"] + task["b"]) in (r2.choices[0].message.content or "") else 0.5
httpx.post(f"{os.environ['AREAL_PROXY_URL']}/rl/set_reward", json={"reward": reward},
           headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}).raise_for_status()
