"""The tokenizer process's engine side: the tokenizer manager, request streams, the offline Engine, K3 chat
rendering and reply parsing."""
