//! all-MiniLM-L6-v2 through this library at every tensor-parallel size it splits into, on the
//! host backend: the sentence-transformers quickstart similarities to four decimals, and the
//! same bits on every rank. Skipped, saying why, without the model (examples/tp-minilm/setup.sh).

use tp_minilm::{
    cosine, embed_all, model_dir, token_ids, tokenizer, Group, Reduce, Weights, QUICKSTART,
    QUICKSTART_COSINES, TP_SIZES,
};

#[test]
fn quickstart_cosines_at_every_tp_size() {
    let Some(dir) = model_dir() else {
        println!("skipped: no model (run examples/tp-minilm/setup.sh, or set TP_MINILM_MODEL)");
        return;
    };
    let weights = Weights::load(&dir).unwrap();
    let ids = token_ids(&tokenizer(&dir).unwrap(), &QUICKSTART).unwrap();
    let mut tp1 = None;
    for tp in TP_SIZES {
        let group = Group::host(&weights, tp).unwrap();
        // embed_all fails if any rank's embedding differs from rank 0's in a bit.
        let (e, _) = embed_all(&group, &ids, Reduce::EXACT).unwrap();
        let q = [
            cosine(&e[0], &e[1]).unwrap(),
            cosine(&e[0], &e[2]).unwrap(),
            cosine(&e[1], &e[2]).unwrap(),
        ];
        let rounded = q.map(|c| (c * 1e4).round() / 1e4);
        assert_eq!(rounded, QUICKSTART_COSINES, "TP {tp}: {q:?}");
        // Splitting only reorders f32 sums: every TP size is within rounding of TP 1.
        let first = tp1.get_or_insert_with(|| e.clone());
        for (a, b) in e.iter().zip(first.iter()) {
            let c = cosine(a, b).unwrap();
            assert!(c > 0.99999, "TP {tp}: cosine {c} to TP 1");
        }
        println!("TP {tp}: {q:?}");
    }
}
