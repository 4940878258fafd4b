"""datamodules/tool_llm."""
