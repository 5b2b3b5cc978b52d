"""A typical vLLM offline-inference script; only the import differs (`from vllm import ...`).

    .venv/bin/python examples/vllm_offline.py
"""

from tokenleap import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(
    n=2, temperature=0.8, top_p=0.95, logprobs=5, presence_penalty=0.5, min_tokens=8, max_tokens=32, seed=0
)

llm = LLM(model="smollm2-135m-instruct", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    for completion in output.outputs:
        first = completion.logprobs[0]
        top = max(first.values(), key=lambda lp: lp.logprob)
        print(
            f"Prompt: {prompt!r}, sample {completion.index}: {completion.text!r} "
            f"(cumulative logprob {completion.cumulative_logprob:.2f}, first token's likeliest: {top.decoded_token!r})"
        )
