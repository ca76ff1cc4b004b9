"""The engine-launching harness: vLLM engines in subprocesses and ``vllm serve`` fleets, a
fake vLLM OpenAI server, random tiny Llamas, the OpenAI client and ``/proc`` readings."""
