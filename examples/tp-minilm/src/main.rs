//! `cargo run --release -p tp-minilm -- [--tp 1,2,3,4,6] [--codecs fp8,q8,...]`: embed the
//! sentence-transformers quickstart and a small corpus with all-MiniLM-L6-v2 at each
//! tensor-parallel size (ranks on the host backend, one thread each), check the published
//! quickstart similarities with exact sums, and for each lossy codec report how far each
//! sentence embedding moves from the exact run, whether every sentence's nearest neighbours
//! keep their order, and the time per forward pass. Run `examples/tp-minilm/setup.sh` first.
//!
//! `--gpu` (a build with `--features cuda`): the sums run on GPU 0 (every rank a virtual rank
//! there) through the `cudarc` calls, the layers on candle's CPU; every embedding must then be
//! the host backend's, bit for bit (the GPU kernels and codecs match the reference exactly).

use std::process::ExitCode;

use allreduce::{BackendKind, Codec, Communicator, DType, GroupConfig, Precision};
use clap::Parser;
use tp_minilm::{
    corpus, cosine, embed_all, embed_all_on, model_dir, neighbours, token_ids, tokenizer, Reduce,
    Sums, Weights, QUICKSTART, QUICKSTART_COSINES, TP_SIZES,
};

/// A group of `tp` whose sums run on GPU 0, and each rank's device buffers.
#[cfg(feature = "cuda")]
fn gpu_group(tp: usize) -> Result<(Vec<Communicator>, Vec<Sums>), Box<dyn std::error::Error>> {
    use allreduce_gpu::device::GpuDevice;
    GpuDevice::<allreduce::cuda::CudaRuntime>::open(0)?.prepare_virtual_ranks()?;
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let comms = Communicator::new_group_cudarc(&vec![ctx.clone(); tp], GroupConfig::new(tp))?;
    let sums = tp_minilm::gpu::GpuSums::for_ranks(&ctx, tp)?;
    Ok((comms, sums.into_iter().map(Sums::Gpu).collect()))
}

#[cfg(not(feature = "cuda"))]
fn gpu_group(_tp: usize) -> Result<(Vec<Communicator>, Vec<Sums>), Box<dyn std::error::Error>> {
    Err("--gpu needs a build with --features cuda".into())
}

fn same_bits(
    a: &[candle_core::Tensor],
    b: &[candle_core::Tensor],
) -> Result<bool, candle_core::Error> {
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
    /// q6a, q4a); their sums travel in bf16
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "fp8,q8,q6,q4,q8a,q6a,q4a"
    )]
    codecs: Vec<Codec>,
    /// The row-parallel sums on GPU 0 (build with --features cuda), checked bit for bit
    /// against the host backend's
    #[arg(long)]
    gpu: bool,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
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
    let place = if args.gpu { "GPU" } else { "host" };
    println!("| TP | sums ({place}) | quickstart cosines (want {QUICKSTART_COSINES:?}) | min cosine to exact | mean cosine to exact | nearest neighbour unchanged | top-5 order unchanged | ms per forward |{}", if args.gpu { " same bits as host |" } else { "" });
    println!(
        "|---|---|---|---|---|---|---|---|{}",
        if args.gpu { "---|" } else { "" }
    );
    for &tp in &args.tp {
        if !TP_SIZES.contains(&tp) {
            return Err(format!("--tp {tp}: the model splits over {TP_SIZES:?} ranks").into());
        }
        let host = Communicator::new_group(BackendKind::Host, GroupConfig::new(tp))?;
        let gpu = if args.gpu { Some(gpu_group(tp)?) } else { None };
        let host_sums: Vec<Sums> = host.iter().map(|_| Sums::Host).collect();
        let (comms, sums) = match &gpu {
            Some((c, s)) => (c.as_slice(), s.as_slice()),
            None => (host.as_slice(), host_sums.as_slice()),
        };
        let (exact, secs) = embed_all_on(&weights, comms, sums, &ids, Reduce::EXACT)?;
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
            let (e, s) = embed_all_on(&weights, comms, sums, &ids, reduce)?;
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
            let versus_host = if args.gpu {
                let (h, _) = embed_all(&weights, &host, &ids, *reduce)?;
                let same = same_bits(emb, &h)?;
                ok &= same;
                if same {
                    " yes |"
                } else {
                    " NO |"
                }
            } else {
                ""
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
    }
    Ok(ok)
}
