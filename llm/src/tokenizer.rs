//! The text tokenizer: a Hugging Face `tokenizer.json`, or the byte-level BPE stored in a GGUF
//! file (`tokenizer.ggml.*`) rebuilt as one (the `tokenizers` crate runs both).

use std::path::Path;
use std::str::FromStr;

use crate::gguf::{Gguf, Value};

/// Why a tokenizer could not be built or run.
#[derive(Debug, thiserror::Error)]
#[error("tokenizer ({source_name}): {what}")]
pub struct TokenizerError {
    /// The file it came from.
    pub source_name: String,
    /// What went wrong.
    pub what: String,
}

/// A tokenizer and its special tokens.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    name: String,
    /// `<|endoftext|>`-like document separator, if the vocabulary has one.
    pub end_of_text: Option<u32>,
}

impl TextTokenizer {
    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let name = path.display().to_string();
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError {
            source_name: name.clone(),
            what: e.to_string(),
        })?;
        Ok(Self::wrap(inner, name))
    }

    /// Rebuilds the GGUF's byte-level BPE (`tokenizer.ggml.model = gpt2`): vocabulary, merges,
    /// control tokens as special added tokens, digits split one by one (llama.cpp's `smollm`
    /// and `llama3`-style pre-tokenizers), GPT-2 byte-level pre-tokenizer and decoder.
    pub fn from_gguf(gguf: &Gguf) -> Result<Self, TokenizerError> {
        let name = gguf.path().display().to_string();
        let fail = |what: String| TokenizerError {
            source_name: name.clone(),
            what,
        };
        let model = gguf
            .metadata
            .get("tokenizer.ggml.model")
            .and_then(Value::as_str);
        if model != Some("gpt2") {
            return Err(fail(format!(
                "tokenizer.ggml.model is {model:?}; only byte-level BPE (`gpt2`) is supported"
            )));
        }
        let strings = |key: &str| -> Result<Vec<String>, TokenizerError> {
            let v = gguf.metadata.get(key).and_then(Value::as_array);
            let v = v.ok_or_else(|| fail(format!("`{key}` is missing")))?;
            v.iter()
                .map(|s| s.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| fail(format!("`{key}` holds a non-string")))
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<u64> = gguf
            .metadata
            .get("tokenizer.ggml.token_type")
            .and_then(Value::as_array)
            .map(|v| v.iter().map(|t| t.as_u64().unwrap_or(1)).collect())
            .unwrap_or_default();
        // llama.cpp token types: 3 control, 4 user-defined: both match as whole tokens.
        let added: Vec<serde_json::Value> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(types.get(*i), Some(3 | 4)))
            .map(|(i, t)| {
                serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": types[i] == 3})
            })
            .collect();
        let vocab: serde_json::Map<String, serde_json::Value> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i.into()))
            .collect();
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
            ]},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges}
        });
        let inner = tokenizers::Tokenizer::from_str(&json.to_string())
            .map_err(|e| fail(format!("rebuilding the BPE: {e}")))?;
        Ok(Self::wrap(inner, name))
    }

    fn wrap(inner: tokenizers::Tokenizer, name: String) -> Self {
        let end_of_text = inner.token_to_id("<|endoftext|>");
        Self {
            inner,
            name,
            end_of_text,
        }
    }

    fn fail(&self, e: impl std::fmt::Display) -> TokenizerError {
        TokenizerError {
            source_name: self.name.clone(),
            what: e.to_string(),
        }
    }

    /// Token ids of `text`; special tokens written in the text (`<|im_start|>`) are matched.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self.inner.encode(text, false).map_err(|e| self.fail(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner.decode(ids, false).map_err(|e| self.fail(e))
    }

    /// The id of token `token`.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Writes it as a Hugging Face `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<(), TokenizerError> {
        self.inner.save(path, false).map_err(|e| self.fail(e))
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::tests::Writer;

    /// GPT-2's byte → printable character map.
    fn byte_chars() -> Vec<char> {
        let printable = |b: u32| {
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b)
        };
        let mut extra = 0;
        (0..256u32)
            .map(|b| {
                if printable(b) {
                    char::from_u32(b).unwrap()
                } else {
                    extra += 1;
                    char::from_u32(255 + extra).unwrap()
                }
            })
            .collect()
    }

    /// A GGUF with two control tokens, the 256 byte tokens and three merges.
    fn synthetic() -> Gguf {
        let mut tokens = vec!["<|endoftext|>".to_string(), "<|im_start|>".to_string()];
        tokens.extend(byte_chars().iter().map(|c| c.to_string()));
        tokens.extend(["he", "ll", "hell"].map(String::from));
        let mut types = vec![3, 3];
        types.extend(std::iter::repeat_n(1, tokens.len() - 2));
        let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
        let mut w = Writer::new();
        w.kv_str("tokenizer.ggml.model", "gpt2")
            .kv_strs("tokenizer.ggml.tokens", &refs)
            .kv_strs("tokenizer.ggml.merges", &["h e", "l l", "he ll"])
            .kv_i32s("tokenizer.ggml.token_type", &types);
        Gguf::parse("tok.gguf".into(), w.bytes()).unwrap()
    }

    #[test]
    fn gguf_bpe_round_trips_and_splits_digits() {
        let mut tokens = vec![];
        let tok = TextTokenizer::from_gguf(&synthetic()).unwrap();
        assert_eq!(tok.end_of_text, Some(0));
        for text in [
            "hello, world! 1234",
            "Ünïcödé\ttabs\n\nand <|im_start|>special",
            "",
        ] {
            let ids = tok.encode(text).unwrap();
            assert_eq!(tok.decode(&ids).unwrap(), text, "{ids:?}");
            tokens.push(ids);
        }
        // "hell" is one merged token; "<|im_start|>" is matched whole; digits stay single.
        assert_eq!(tokens[0][0], tok.token_id("hell").unwrap());
        assert!(tokens[1].contains(&1));
        let digits = tok.encode("1234").unwrap();
        assert_eq!(digits.len(), 4);
    }

    #[test]
    fn other_tokenizer_models_are_refused_by_name() {
        let mut w = Writer::new();
        w.kv_str("tokenizer.ggml.model", "llama");
        let g = Gguf::parse("spm.gguf".into(), w.bytes()).unwrap();
        let e = TextTokenizer::from_gguf(&g).err().unwrap().to_string();
        assert!(
            e.contains("spm.gguf") && e.contains("only byte-level BPE"),
            "{e}"
        );
    }
}
