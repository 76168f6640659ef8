"""Architecture names (config.json architectures[0]) that more than one engine's rows test."""

DSV4 = "DeepseekV4ForCausalLM"
GPT_OSS = "GptOssForCausalLM"
