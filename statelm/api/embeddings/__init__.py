"""Embeddings, reranking and scoring: OpenAI's /v1/embeddings and the Cohere/Jina-shaped /v1/rerank and /v1/score."""
