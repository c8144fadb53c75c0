"""The artifacts every stage reads and writes, and their one owner each: JSONL files, tapes,
samples, the LLM-call log, the run directory's layout, output paths, GSM8k problems, model
directories, tokenizers and chat rendering. Imports only the leaves (agent, errors, progress).
"""
