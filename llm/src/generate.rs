//! Using a trained [`Llama`]: held-out NLL over token windows and text generation (greedy or
//! nucleus sampling).

use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};

use crate::model::Llama;

/// `ids` as a `[1, len]` token tensor.
pub fn token_tensor<B: Backend>(ids: &[u32], device: &B::Device) -> Tensor<B, 2, Int> {
    let data = TensorData::new(ids.iter().map(|x| *x as i64).collect(), [1, ids.len()]);
    Tensor::from_data(data, device)
}

/// How [`Llama::generate`] picks each token.
#[derive(Clone, Copy, Debug)]
pub enum Sampling {
    /// The most probable token.
    Greedy,
    /// Nucleus sampling: from the most probable tokens whose mass reaches `p`, seeded.
    TopP {
        /// Probability mass kept.
        p: f64,
        /// Seed of the draws.
        seed: u64,
    },
}

impl<B: Backend> Llama<B> {
    /// Mean next-token NLL (nats/token) over `windows`, each `len + 1` tokens.
    pub fn mean_nll(&self, windows: &[Vec<u32>], device: &B::Device) -> f64 {
        let total: f64 = windows
            .iter()
            .map(|w| {
                self.loss(token_tensor(w, device))
                    .into_scalar()
                    .elem::<f64>()
            })
            .sum();
        total / windows.len() as f64
    }

    /// Up to `n` tokens continuing `prompt`, stopping after `stop`.
    pub fn generate(
        &self,
        prompt: &[u32],
        n: usize,
        stop: Option<u32>,
        sampling: Sampling,
        device: &B::Device,
    ) -> Vec<u32> {
        let mut ids = prompt.to_vec();
        let mut state = match sampling {
            Sampling::TopP { seed, .. } => seed | 1,
            Sampling::Greedy => 1,
        };
        for _ in 0..n {
            let logits = self.forward(token_tensor(&ids, device));
            let [_, s, v] = logits.dims();
            let last = logits.slice([0..1, s - 1..s, 0..v]).reshape([v]);
            let next = match sampling {
                Sampling::Greedy => last.argmax(0).into_scalar().elem::<i64>() as u32,
                Sampling::TopP { p, .. } => {
                    let probs = softmax(last, 0).into_data().convert::<f32>();
                    let probs = probs.to_vec::<f32>().expect("f32 probabilities");
                    // xorshift64*: a uniform draw in [0, 1).
                    state ^= state >> 12;
                    state ^= state << 25;
                    state ^= state >> 27;
                    let u = (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64
                        / (1u64 << 53) as f64;
                    nucleus(&probs, p, u)
                }
            };
            ids.push(next);
            if Some(next) == stop {
                break;
            }
        }
        ids[prompt.len()..].to_vec()
    }
}

/// The token drawn by `u` ∈ [0, 1) from the most probable tokens whose mass reaches `p`.
fn nucleus(probs: &[f32], p: f64, u: f64) -> u32 {
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|a, b| probs[*b].total_cmp(&probs[*a]));
    let mut kept = Vec::new();
    let mut mass = 0.0;
    for i in order {
        kept.push(i);
        mass += probs[i] as f64;
        if mass >= p {
            break;
        }
    }
    let mut target = u * mass;
    for i in &kept {
        target -= probs[*i] as f64;
        if target < 0.0 {
            return *i as u32;
        }
    }
    *kept.last().expect("at least one token") as u32
}
