"""Layer 2, tool-use text: the GPT4Tools prompt template, ReAct parsing and the SR metrics."""
