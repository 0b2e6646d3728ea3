//! `cargo run --release -p tp-minilm -- [--tp 1,2,3,4,6] [--codecs fp8,q8,...]`: embed the
//! sentence-transformers quickstart and a small corpus with all-MiniLM-L6-v2 at each
//! tensor-parallel size (ranks on the host backend, one thread each), check the published
//! quickstart similarities with exact sums, and for each lossy codec report how far each
//! sentence embedding moves from the exact run, whether every sentence's nearest neighbours
//! keep their order, and the time per forward pass. Run `examples/tp-minilm/setup.sh` first.
//!
//! `--on gpu-sums` (a build with `--features cuda`): the sums run on GPU 0 (every rank a
//! virtual rank there) through the `cudarc` calls, the layers on candle's CPU; every embedding
//! must then be the host backend's, bit for bit (the GPU kernels and codecs match the
//! reference exactly).
//!
//! `--on gpu` (a build with `--features candle-cuda`, see scripts/with-candle-cuda.sh): the
//! whole model on GPU 0 as candle CUDA tensors, one candle device (and stream) per rank, the
//! sums in place through allreduce-candle's op; the exact runs must stay within 1e-4 cosine
//! of the host backend's.

use std::process::ExitCode;

use allreduce::{Codec, DType, Precision, Strategy};
use candle_core::Tensor;
use clap::{Parser, ValueEnum};
use tp_minilm::{
    corpus, cosine, embed_all, model_dir, neighbours, token_ids, tokenizer, Group, Reduce, Weights,
    QUICKSTART, QUICKSTART_COSINES, TP_SIZES,
};

/// Where the ranks run.
#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum On {
    /// Layers and sums on the CPU (a host-backend group).
    Host,
    /// The sums on GPU 0 through the `cudarc` calls, the layers on the CPU (--features cuda).
    GpuSums,
    /// Layers and sums on GPU 0: candle CUDA tensors, summed in place by allreduce-candle's
    /// op (--features candle-cuda).
    Gpu,
}

/// A group of `tp` whose sums run on GPU 0, and each rank's device buffers.
#[cfg(feature = "cuda")]
fn gpu_sums_group(weights: &Weights, tp: usize) -> Result<Group, Box<dyn std::error::Error>> {
    use allreduce::{Communicator, GroupConfig};
    use allreduce_gpu::device::GpuDevice;
    GpuDevice::<allreduce::cuda::CudaRuntime>::open(0)?.prepare_virtual_ranks()?;
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let comms = Communicator::new_group_cudarc(&vec![ctx.clone(); tp], GroupConfig::new(tp))?;
    let sums = tp_minilm::gpu::GpuSums::for_ranks(&ctx, tp)?;
    let sums = sums.into_iter().map(tp_minilm::Sums::Gpu).collect();
    let cpu = vec![candle_core::Device::Cpu; tp];
    Ok(Group::new(weights, comms, sums, &cpu)?)
}

#[cfg(not(feature = "cuda"))]
fn gpu_sums_group(_: &Weights, _tp: usize) -> Result<Group, Box<dyn std::error::Error>> {
    Err("--on gpu-sums needs a build with --features cuda".into())
}

/// A group of `tp` virtual ranks on GPU 0, each with a candle device (and stream) of its own.
#[cfg(feature = "candle-cuda")]
fn gpu_group(weights: &Weights, tp: usize) -> Result<Group, Box<dyn std::error::Error>> {
    use allreduce::{Communicator, GroupConfig};
    use allreduce_gpu::device::GpuDevice;
    GpuDevice::<allreduce::cuda::CudaRuntime>::open(0)?.prepare_virtual_ranks()?;
    let devices = (0..tp)
        .map(|_| candle_core::Device::new_cuda_with_stream(0))
        .collect::<Result<Vec<_>, _>>()?;
    let contexts = devices
        .iter()
        .map(|d| Ok(d.as_cuda_device()?.cuda_stream().context().clone()))
        .collect::<Result<Vec<_>, candle_core::Error>>()?;
    let comms = Communicator::new_group_cudarc(&contexts, GroupConfig::new(tp))?;
    let sums = comms.iter().map(|_| tp_minilm::Sums::InPlace).collect();
    Ok(Group::new(weights, comms, sums, &devices)?)
}

#[cfg(not(feature = "candle-cuda"))]
fn gpu_group(_: &Weights, _tp: usize) -> Result<Group, Box<dyn std::error::Error>> {
    Err("--on gpu needs a build with --features candle-cuda".into())
}

fn min_cosine(a: &[Tensor], b: &[Tensor]) -> Result<f32, candle_core::Error> {
    (a.iter().zip(b))
        .map(|(x, y)| cosine(x, y))
        .try_fold(f32::INFINITY, |m, c| Ok(m.min(c?)))
}

fn same_bits(a: &[Tensor], b: &[Tensor]) -> Result<bool, candle_core::Error> {
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (x.to_vec1::<f32>()?, y.to_vec1::<f32>()?);
        if x.iter().zip(&y).any(|(p, q)| p.to_bits() != q.to_bits()) {
            return Ok(false);
        }
    }
    Ok(true)
}

#[derive(Parser)]
struct Args {
    /// Tensor-parallel sizes, comma-separated (the model splits over 1, 2, 3, 4 and 6)
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4,6")]
    tp: Vec<usize>,
    /// Lossy codecs to compare with the exact run, comma-separated (fp8, q8, q6, q4, q8a,
    /// q6a, q4a, and format v2's q8v2, q6v2, q4v2, fp4); their sums travel in bf16
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "fp8,q8,q6,q4,q8a,q6a,q4a,q8v2,q6v2,q4v2,fp4"
    )]
    codecs: Vec<Codec>,
    /// Where the ranks run: gpu-sums is checked bit for bit against the host backend, gpu
    /// (whose matmuls round differently) by cosine to it
    #[arg(long, value_enum, default_value = "host")]
    on: On,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.on == On::Gpu && std::env::var_os("CUDA_MODULE_LOADING").is_none() {
        // Virtual ranks spin in each other's all-reduce; a kernel that cuBLAS loads lazily
        // while a peer spins may wait for the device. Loaded eagerly, nothing loads mid-run.
        // (Set before any CUDA call, while this is the only thread.)
        std::env::set_var("CUDA_MODULE_LOADING", "EAGER");
    }
    match run(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("tp-minilm: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(args: Args) -> Result<bool, Box<dyn std::error::Error>> {
    let dir =
        model_dir().ok_or("no model: run examples/tp-minilm/setup.sh (or set TP_MINILM_MODEL)")?;
    let weights = Weights::load(&dir)?;
    let tok = tokenizer(&dir)?;
    let corpus = corpus();
    let ids = token_ids(&tok, &corpus)?;
    // The quickstart sentences are the corpus's first three.
    assert_eq!(&corpus[..3], &QUICKSTART);
    let mut ok = true;
    let versus = match args.on {
        On::Host => "",
        On::GpuSums => " same bits as host |",
        On::Gpu => " min cosine to host |",
    };
    let place = args.on.to_possible_value().expect("a named value");
    println!("| TP | sums (on {}) | quickstart cosines (want {QUICKSTART_COSINES:?}) | min cosine to exact | mean cosine to exact | nearest neighbour unchanged | top-5 order unchanged | ms per forward |{versus}", place.get_name());
    println!(
        "|---|---|---|---|---|---|---|---|{}",
        if versus.is_empty() { "" } else { "---|" }
    );
    for &tp in &args.tp {
        if !TP_SIZES.contains(&tp) {
            return Err(format!("--tp {tp}: the model splits over {TP_SIZES:?} ranks").into());
        }
    }
    for &tp in &args.tp {
        // A TP size that fails is a row of the table; the next size still runs.
        match rows(&args, tp, &weights, &ids) {
            Ok(good) => ok &= good,
            Err(e) => {
                println!("| {tp} | failed: {e} |");
                ok = false;
            }
        }
    }
    Ok(ok)
}

/// The table's rows of one TP size: the exact run, then each lossy one, with every check;
/// false when a check fails.
fn rows(
    args: &Args,
    tp: usize,
    weights: &Weights,
    ids: &[Vec<u32>],
) -> Result<bool, Box<dyn std::error::Error>> {
    let mut ok = true;
    let host = Group::host(weights, tp)?;
    let other = match args.on {
        On::Host => None,
        On::GpuSums => Some(gpu_sums_group(weights, tp)?),
        On::Gpu => Some(gpu_group(weights, tp)?),
    };
    let group = other.as_ref().unwrap_or(&host);
    let (exact, secs) = embed_all(group, ids, Reduce::EXACT)?;
    let exact_nn = neighbours(&exact)?;
    let mut runs = vec![(Reduce::EXACT, exact.clone(), secs)];
    let wire = Some(DType::BF16);
    for reduce in std::iter::once(Reduce {
        wire,
        precision: Precision::Exact,
    })
    .chain(args.codecs.iter().map(|&c| Reduce {
        wire,
        precision: Precision::Lossy(c),
    })) {
        // A codec this backend has no kernels for is a row saying so (the host backend runs
        // every codec; a GPU one may lack a format's kernels).
        if reduce.precision != Precision::Exact {
            let available = (group.comms[0]).strategy_available(
                Strategy::QuantizedTwoShot,
                DType::BF16,
                reduce.precision,
            );
            if let Err(e) = available {
                println!("| {tp} | {} | not run: {e} |", reduce.name());
                continue;
            }
        }
        let (e, s) = embed_all(group, ids, reduce)?;
        runs.push((reduce, e, s));
    }
    for (reduce, emb, secs) in &runs {
        let q = [
            cosine(&emb[0], &emb[1])?,
            cosine(&emb[0], &emb[2])?,
            cosine(&emb[1], &emb[2])?,
        ];
        if *reduce == Reduce::EXACT && weights.as_published() {
            let rounded = q.map(|c| (c * 1e4).round() / 1e4);
            if rounded != QUICKSTART_COSINES {
                eprintln!("TP {tp}: quickstart cosines {q:?}, want {QUICKSTART_COSINES:?}");
                ok = false;
            }
        }
        let to_exact: Vec<f32> = (emb.iter().zip(&exact))
            .map(|(a, b)| cosine(a, b))
            .collect::<Result<_, _>>()?;
        let min = to_exact.iter().copied().fold(f32::INFINITY, f32::min);
        let mean = to_exact.iter().sum::<f32>() / to_exact.len() as f32;
        let nn = neighbours(emb)?;
        let first = (nn.iter().zip(&exact_nn))
            .filter(|(a, b)| a[0] == b[0])
            .count();
        let top5 = (nn.iter().zip(&exact_nn))
            .filter(|(a, b)| a[..5] == b[..5])
            .count();
        let versus_host = match args.on {
            On::Host => String::new(),
            On::GpuSums => {
                let (h, _) = embed_all(&host, ids, *reduce)?;
                let same = same_bits(emb, &h)?;
                ok &= same;
                if same { " yes |" } else { " NO |" }.into()
            }
            On::Gpu => {
                let (h, _) = embed_all(&host, ids, *reduce)?;
                let c = min_cosine(emb, &h)?;
                // f32 layers on another device round differently; an exact sum keeps
                // the embedding (a lossy codec's rounding may fall otherwise: reported).
                if reduce.precision == Precision::Exact {
                    ok &= c > 0.9999;
                }
                format!(" {c:.6} |")
            }
        };
        println!(
            "| {tp} | {} | {:.4}, {:.4}, {:.4} | {min:.6} | {mean:.6} | {first}/{n} | {top5}/{n} | {:.2} |{versus_host}",
            reduce.name(),
            q[0],
            q[1],
            q[2],
            secs * 1e3,
            n = emb.len()
        );
    }
    Ok(ok)
}
