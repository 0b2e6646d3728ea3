//! all-MiniLM-L6-v2 (a 6-layer BERT, hidden 384, 12 heads, FFN 1536) with tensor parallelism
//! over `tp` ranks, Megatron style: the query/key/value and FFN-input projections split by
//! columns (each rank owns `12 / tp` heads and `1536 / tp` FFN units), the attention-output
//! and FFN-output projections split by rows, their partial products summed across ranks by
//! this library (`allreduce_candle::all_reduce_`, two calls per layer), and the bias, residual
//! and LayerNorm applied after the sum on every rank. Embeddings and norms are replicated.
//! Sentence embeddings are the mean of the last hidden states, L2-normalised, as the
//! sentence-transformers model defines them.

#[cfg(feature = "cuda")]
pub mod gpu;

use std::collections::HashMap;
use std::path::Path;

use allreduce::{Communicator, DType as ArDType, Precision, Strategy};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::LayerNorm;

pub const HIDDEN: usize = 384;
pub const HEADS: usize = 12;
pub const HEAD_DIM: usize = 32;
pub const FFN: usize = 1536;
pub const LAYERS: usize = 6;
const LN_EPS: f64 = 1e-12;

/// The tensor-parallel sizes the model splits evenly into (heads and FFN units).
pub const TP_SIZES: [usize; 5] = [1, 2, 3, 4, 6];

/// The model's weights, loaded once and shared by every rank.
pub struct Weights(HashMap<String, Tensor>, bool);

impl Weights {
    pub fn load(model_dir: &Path) -> Result<Self> {
        let path = model_dir.join("model.safetensors");
        // Float weights of any width (setup.sh --f16 halves the file) compute in f32.
        let mut w = candle_core::safetensors::load(path, &Device::Cpu)?;
        let mut as_published = true;
        for t in w.values_mut() {
            if t.dtype().is_float() && t.dtype() != DType::F32 {
                as_published = false;
                *t = t.to_dtype(DType::F32)?;
            }
        }
        Ok(Weights(w, as_published))
    }

    /// Whether the weights are the published f32 ones (the quickstart similarities hold to
    /// four decimals only for them).
    pub fn as_published(&self) -> bool {
        self.1
    }

    fn get(&self, name: &str) -> Result<&Tensor> {
        self.0
            .get(name)
            .ok_or_else(|| candle_core::Error::Msg(format!("model.safetensors lacks {name}")))
    }
}

/// How the row-parallel sums travel: exact in the model's f32, or through a 16-bit dtype
/// (the codecs carry f16 and bf16) exactly or with a lossy codec.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reduce {
    pub wire: Option<ArDType>,
    pub precision: Precision,
}

impl Reduce {
    pub const EXACT: Reduce = Reduce {
        wire: None,
        precision: Precision::Exact,
    };

    pub fn name(&self) -> String {
        match (self.wire, self.precision) {
            (None, _) => "exact f32".into(),
            (Some(d), Precision::Exact) => format!("exact {d}"),
            (Some(d), Precision::Lossy(c)) => format!("{c} ({d})"),
        }
    }
}

/// Where a rank's row-parallel sums run.
pub enum Sums {
    /// In place on the tensor, where the layers run: a host-backend group for CPU tensors, a
    /// CUDA group for candle CUDA tensors (`allreduce_candle::all_reduce_`'s op either way).
    InPlace,
    /// On the GPU through the cudarc calls (a CUDA group), the layers staying on the CPU.
    #[cfg(feature = "cuda")]
    Gpu(gpu::GpuSums),
}

/// One rank's slice of one layer.
struct Layer {
    qkv: [(Tensor, Tensor); 3],
    attn_out: (Tensor, Tensor),
    attn_norm: LayerNorm,
    ffn_in: (Tensor, Tensor),
    ffn_out: (Tensor, Tensor),
    ffn_norm: LayerNorm,
}

/// Rank `rank` of `tp`'s part of the model, on the device its layers run on.
pub struct Shard {
    device: Device,
    rank: usize,
    tp: usize,
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    embed_norm: LayerNorm,
    layers: Vec<Layer>,
}

/// `x @ w.T + b` (`w`: `[out, in]`).
fn linear(x: &Tensor, (w, b): &(Tensor, Tensor)) -> Result<Tensor> {
    x.matmul(&w.t()?)?.broadcast_add(b)
}

impl Shard {
    /// With its weights copied to `device`.
    pub fn on(weights: &Weights, rank: usize, tp: usize, device: &Device) -> Result<Self> {
        if !TP_SIZES.contains(&tp) || rank >= tp {
            return Err(candle_core::Error::Msg(format!(
                "rank {rank} of {tp}: the model splits over {TP_SIZES:?} ranks"
            )));
        }
        let heads = HEADS / tp * HEAD_DIM;
        let ffn = FFN / tp;
        // Column-parallel: this rank's rows of the weight and of the bias.
        let cols = |name: &str, n: usize| -> Result<(Tensor, Tensor)> {
            let w = weights
                .get(&format!("{name}.weight"))?
                .narrow(0, rank * n, n)?;
            let b = weights
                .get(&format!("{name}.bias"))?
                .narrow(0, rank * n, n)?;
            Ok((w.contiguous()?.to_device(device)?, b.to_device(device)?))
        };
        // Row-parallel: this rank's columns of the weight; the bias is added after the sum.
        let rows = |name: &str, n: usize| -> Result<(Tensor, Tensor)> {
            let w = weights
                .get(&format!("{name}.weight"))?
                .narrow(1, rank * n, n)?;
            Ok((
                w.contiguous()?.to_device(device)?,
                weights.get(&format!("{name}.bias"))?.to_device(device)?,
            ))
        };
        let whole = |name: &str| weights.get(name)?.to_device(device);
        let norm = |prefix: &str| -> Result<LayerNorm> {
            Ok(LayerNorm::new(
                whole(&format!("{prefix}.weight"))?,
                whole(&format!("{prefix}.bias"))?,
                LN_EPS,
            ))
        };
        let layers = (0..LAYERS)
            .map(|l| {
                let p = format!("encoder.layer.{l}");
                Ok(Layer {
                    qkv: [
                        cols(&format!("{p}.attention.self.query"), heads)?,
                        cols(&format!("{p}.attention.self.key"), heads)?,
                        cols(&format!("{p}.attention.self.value"), heads)?,
                    ],
                    attn_out: rows(&format!("{p}.attention.output.dense"), heads)?,
                    attn_norm: norm(&format!("{p}.attention.output.LayerNorm"))?,
                    ffn_in: cols(&format!("{p}.intermediate.dense"), ffn)?,
                    ffn_out: rows(&format!("{p}.output.dense"), ffn)?,
                    ffn_norm: norm(&format!("{p}.output.LayerNorm"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Shard {
            device: device.clone(),
            rank,
            tp,
            word: whole("embeddings.word_embeddings.weight")?,
            position: whole("embeddings.position_embeddings.weight")?,
            token_type: whole("embeddings.token_type_embeddings.weight")?,
            embed_norm: norm("embeddings.LayerNorm")?,
            layers,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// One sentence's token ids and positions on this shard's device.
    pub fn inputs(&self, ids: &[u32]) -> Result<(Tensor, Tensor)> {
        Ok((
            Tensor::new(ids, &self.device)?,
            Tensor::arange(0u32, ids.len() as u32, &self.device)?,
        ))
    }

    /// The sentence embedding (L2-normalised mean of the last hidden states) of one sentence's
    /// token ids and positions on this shard's device ([`Shard::inputs`]), every rank calling
    /// it with the same ids; `group` is this rank's communicator (a group of `tp`) and where
    /// its sums run, `reduce` how the row-parallel sums travel. With no
    /// communicator, the partial products are not summed: a pass that only loads the kernels
    /// this rank runs (a kernel loaded later, while peers wait for this rank in an all-reduce,
    /// may wait for the device).
    pub fn forward(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        group: Option<(&Communicator, &Sums)>,
        reduce: Reduce,
    ) -> Result<Tensor> {
        let t = ids.dim(0)?;
        let x = self
            .word
            .embedding(ids)?
            .add(&self.position.embedding(pos)?)?
            .broadcast_add(&self.token_type.get(0)?)?;
        let mut x = self.embed_norm.forward(&x)?;
        let local_heads = HEADS / self.tp;
        let scale = 1.0 / (HEAD_DIM as f64).sqrt();
        for layer in &self.layers {
            // [t, local_heads * 32] -> [local_heads, t, 32]
            let split = |y: Tensor| -> Result<Tensor> {
                y.reshape((t, local_heads, HEAD_DIM))?
                    .transpose(0, 1)?
                    .contiguous()
            };
            let q = split(linear(&x, &layer.qkv[0])?)?;
            let k = split(linear(&x, &layer.qkv[1])?)?;
            let v = split(linear(&x, &layer.qkv[2])?)?;
            let scores = (q.matmul(&k.t()?)? * scale)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            let ctx = probs
                .matmul(&v)?
                .transpose(0, 1)?
                .reshape((t, local_heads * HEAD_DIM))?;
            let attn = self.row_parallel(&ctx, &layer.attn_out, group, reduce)?;
            x = layer.attn_norm.forward(&(attn + &x)?)?;
            let h = linear(&x, &layer.ffn_in)?.gelu_erf()?;
            let out = self.row_parallel(&h, &layer.ffn_out, group, reduce)?;
            x = layer.ffn_norm.forward(&(out + &x)?)?;
        }
        let mean = x.mean(0)?;
        let norm = mean.sqr()?.sum_all()?.sqrt()?;
        mean.broadcast_div(&norm)
    }

    /// This rank's partial product, summed over the ranks in place, then the bias.
    fn row_parallel(
        &self,
        x: &Tensor,
        (w, b): &(Tensor, Tensor),
        group: Option<(&Communicator, &Sums)>,
        reduce: Reduce,
    ) -> Result<Tensor> {
        let partial = x.matmul(&w.t()?)?;
        #[cfg(feature = "cuda")]
        if let Some((comm, Sums::Gpu(g))) = group {
            return g.sum(&partial, comm, reduce)?.broadcast_add(b);
        }
        // The casts to and from the wire dtype run in the pass with no sums too, so that it
        // loads their kernels.
        let partial = match reduce.wire {
            None => partial,
            Some(ArDType::F16) => partial.to_dtype(DType::F16)?,
            Some(ArDType::BF16) => partial.to_dtype(DType::BF16)?,
            Some(ArDType::F32) => partial,
        };
        if let Some((comm, _)) = group {
            let mut op = allreduce_candle::AllReduce::new(comm).precision(reduce.precision);
            if matches!(reduce.precision, Precision::Lossy(_)) {
                // The calls here are a few KiB, where Auto takes an exact path; the codec is
                // what is being measured.
                op = op.strategy(Strategy::QuantizedTwoShot);
            }
            partial.inplace_op1(&op)?;
        }
        partial.to_dtype(DType::F32)?.broadcast_add(b)
    }
}

/// Cosine similarity of two L2-normalised embeddings.
pub fn cosine(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a * b)?.sum_all()?.to_scalar::<f32>()
}

/// A tensor-parallel group's ranks: each rank's communicator, where its sums run, and its
/// shard of the model (on the device its layers run on).
pub struct Group {
    pub comms: Vec<Communicator>,
    pub sums: Vec<Sums>,
    pub shards: Vec<Shard>,
}

impl Group {
    /// Rank r's layers on `devices[r]`, its sums as `sums[r]` says, over `comms[r]`.
    pub fn new(
        weights: &Weights,
        comms: Vec<Communicator>,
        sums: Vec<Sums>,
        devices: &[Device],
    ) -> Result<Self> {
        let tp = comms.len();
        if sums.len() != tp || devices.len() != tp {
            return Err(candle_core::Error::Msg(format!(
                "{tp} communicators, {} sums, {} devices",
                sums.len(),
                devices.len()
            )));
        }
        let shards = (0..tp)
            .map(|r| Shard::on(weights, r, tp, &devices[r]))
            .collect::<Result<Vec<_>>>()?;
        Ok(Group {
            comms,
            sums,
            shards,
        })
    }

    /// Every rank on the CPU, summing over a host-backend group.
    pub fn host(weights: &Weights, tp: usize) -> Result<Self> {
        let comms = Communicator::new_group(
            allreduce::BackendKind::Host,
            allreduce::GroupConfig::new(tp),
        )
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let sums = comms.iter().map(|_| Sums::InPlace).collect();
        Group::new(weights, comms, sums, &vec![Device::Cpu; tp])
    }

    pub fn tp(&self) -> usize {
        self.comms.len()
    }
}

/// Every sentence's embedding (on the CPU) through `group` (one thread per rank), and the
/// mean seconds per forward pass (one sentence through every rank, as the slowest rank saw
/// it). Each rank first puts every sentence's inputs on its device and runs each sentence
/// (one, on the CPU) with no sums, then all start together: the time is the forward passes',
/// not the first kernel loads' or parameter uploads'. Fails unless every rank's embeddings
/// have the same bits.
pub fn embed_all(group: &Group, ids: &[Vec<u32>], reduce: Reduce) -> Result<(Vec<Tensor>, f64)> {
    let start = std::sync::Barrier::new(group.tp());
    let per_rank: Vec<Result<(Vec<Tensor>, f64)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (group.shards.iter().zip(&group.comms).zip(&group.sums))
            .map(|((shard, comm), sums)| {
                let start = &start;
                s.spawn(move || {
                    let ran = rank_embeds(shard, comm, sums, ids, reduce, start);
                    if ran.is_err() {
                        // Peers waiting on this rank leave at once rather than at a deadline.
                        let _ = comm.abort();
                    }
                    ran
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    // A failing rank aborts the group, so its peers fail too, with `Aborted`: report the
    // rank whose failure started it.
    if per_rank.iter().any(|r| r.is_err()) {
        let failed = per_rank
            .iter()
            .enumerate()
            .filter_map(|(r, res)| res.as_ref().err().map(|e| (r, e.to_string())));
        let (first, rest): (Vec<_>, Vec<_>) = failed.partition(|(_, e)| !e.contains("aborted"));
        let all: Vec<String> = (first.iter().chain(&rest))
            .map(|(r, e)| format!("rank {r}: {e}"))
            .collect();
        return Err(candle_core::Error::Msg(all.join("; ")));
    }
    let per_rank = per_rank.into_iter().collect::<Result<Vec<_>>>()?;
    let seconds = per_rank.iter().map(|(_, t)| *t).fold(0.0, f64::max);
    let mut embeddings: Vec<Vec<Tensor>> = per_rank.into_iter().map(|(e, _)| e).collect();
    // Every rank holds the same embeddings (the sums are bitwise equal across ranks).
    let first = embeddings.swap_remove(0);
    for (r, other) in embeddings.iter().enumerate() {
        for (a, b) in first.iter().zip(other) {
            let same = (a.to_vec1::<f32>()?.iter().zip(b.to_vec1::<f32>()?))
                .all(|(x, y)| x.to_bits() == y.to_bits());
            if !same {
                return Err(candle_core::Error::Msg(format!(
                    "rank {} embedded a sentence differently from rank 0",
                    r + 1
                )));
            }
        }
    }
    Ok((first, seconds))
}

/// One rank's part of [`embed_all`]: its embeddings, copied to the CPU once all are done, and
/// its seconds per forward pass.
fn rank_embeds(
    shard: &Shard,
    comm: &Communicator,
    sums: &Sums,
    ids: &[Vec<u32>],
    reduce: Reduce,
    start: &std::sync::Barrier,
) -> Result<(Vec<Tensor>, f64)> {
    // Nothing is copied between host and device while the ranks run: a copy from pageable
    // memory syncs its stream first and goes through the driver's staging buffer, which every
    // rank on the GPU shares, so a rank whose stream waits in an all-reduce for a peer can hold
    // up the peer's copy before that peer's all-reduce: both wait until the deadline. candle
    // uploads the shapes and strides of every non-contiguous operand (the broadcast bias adds,
    // the transposes) from the host before its kernel; with its parameter cache on (a
    // guard of this thread), each distinct upload is made once and kept on the device. The
    // pass with no sums over every sentence makes each of them (and loads every kernel)
    // before the ranks meet.
    #[cfg(feature = "candle-cuda")]
    let _cached = match shard.device() {
        Device::Cuda(d) => Some(d.enable_cuda_graph_htod_cache()),
        _ => None,
    };
    let primed = || -> Result<Vec<(Tensor, Tensor)>> {
        let inputs = ids
            .iter()
            .map(|s| shard.inputs(s))
            .collect::<Result<Vec<_>>>()?;
        // On the CPU there is nothing to load or upload: one pass warms the caches.
        let prime = if shard.device().is_cpu() {
            1
        } else {
            inputs.len()
        };
        for (i, p) in inputs.iter().take(prime) {
            shard.forward(i, p, None, reduce)?;
        }
        shard.device().synchronize()?;
        Ok(inputs)
    };
    let primed = primed();
    // Every rank reaches the barrier, failed or not (a failure then aborts the group).
    start.wait();
    let inputs = primed?;
    let t0 = std::time::Instant::now();
    let mut out = Vec::with_capacity(inputs.len());
    for (i, p) in &inputs {
        out.push(shard.forward(i, p, Some((comm, sums)), reduce)?);
        // One sentence at a time, as a latency-bound server runs it.
        shard.device().synchronize()?;
    }
    let seconds = t0.elapsed().as_secs_f64() / inputs.len().max(1) as f64;
    let out = out
        .iter()
        .map(|e| e.to_device(&Device::Cpu))
        .collect::<Result<Vec<_>>>()?;
    Ok((out, seconds))
}

/// The tokenizer of the model folder, without padding (one sentence per call).
pub fn tokenizer(model_dir: &Path) -> std::result::Result<tokenizers::Tokenizer, String> {
    let mut t = tokenizers::Tokenizer::from_file(model_dir.join("tokenizer.json"))
        .map_err(|e| format!("{}: {e}", model_dir.join("tokenizer.json").display()))?;
    t.with_padding(None);
    Ok(t)
}

pub fn token_ids(
    t: &tokenizers::Tokenizer,
    sentences: &[&str],
) -> std::result::Result<Vec<Vec<u32>>, String> {
    sentences
        .iter()
        .map(|s| {
            t.encode(*s, true)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| format!("tokenizing {s:?}: {e}"))
        })
        .collect()
}

/// The model folder: `$TP_MINILM_MODEL`, else `examples/tp-minilm/model` (what setup.sh
/// fills), if it holds the weights and the tokenizer.
pub fn model_dir() -> Option<std::path::PathBuf> {
    let dir = match std::env::var_os("TP_MINILM_MODEL") {
        Some(d) => std::path::PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("model"),
    };
    (dir.join("model.safetensors").is_file() && dir.join("tokenizer.json").is_file()).then_some(dir)
}

/// The sentence-transformers quickstart's sentences and its published similarities
/// (0-1, 0-2, 1-2) at four decimals.
pub const QUICKSTART: [&str; 3] = [
    "The weather is lovely today.",
    "It's so sunny outside!",
    "He drove to the stadium.",
];
pub const QUICKSTART_COSINES: [f32; 3] = [0.6660, 0.1046, 0.1411];

/// A small corpus for nearest-neighbour order (corpus.txt, one sentence per line).
pub fn corpus() -> Vec<&'static str> {
    include_str!("../corpus.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect()
}

/// For each sentence, the others ordered by cosine, nearest first.
pub fn neighbours(embeddings: &[Tensor]) -> Result<Vec<Vec<usize>>> {
    let n = embeddings.len();
    let mut sims = vec![vec![0f32; n]; n];
    for i in 0..n {
        for j in 0..n {
            sims[i][j] = cosine(&embeddings[i], &embeddings[j])?;
        }
    }
    Ok((0..n)
        .map(|i| {
            let mut order: Vec<usize> = (0..n).filter(|&j| j != i).collect();
            order.sort_by(|&a, &b| sims[i][b].total_cmp(&sims[i][a]));
            order
        })
        .collect())
}
