//! The device handles over the mock runtime, whose device memory is host memory: bounds and
//! word checks are error values, and data goes where the offsets say.

use allreduce_core::Error;

use super::*;
use crate::group::tests::{take_launches, Mock};

fn setup() -> (GpuDevice<Mock>, GpuStream<Mock>) {
    let dev = GpuDevice::<Mock>::open(0).unwrap();
    let s = GpuStream::new(&dev).unwrap();
    (dev, s)
}

#[test]
fn upload_download_fill_and_copy_land_at_their_offsets() {
    let (_dev, s) = setup();
    let a = DeviceBuffer::zeroed(16, &s).unwrap();
    let mut out = [0xffu8; 16];
    a.download(&mut out, &s).unwrap();
    assert_eq!(out, [0; 16]);
    a.upload_at(4, &[1, 2, 3], &s).unwrap();
    a.fill(8, 8, Fill::U16(0x8000), &s).unwrap();
    a.download(&mut out, &s).unwrap();
    assert_eq!(
        out,
        [0, 0, 0, 0, 1, 2, 3, 0, 0, 0x80, 0, 0x80, 0, 0x80, 0, 0x80]
    );
    let b = DeviceBuffer::from_host(&[9; 8], &s).unwrap();
    a.copy_from(2, &b, 1, 3, &s).unwrap();
    let mut part = [0u8; 6];
    a.download_at(1, &mut part, &s).unwrap();
    assert_eq!(part, [0, 9, 9, 9, 2, 3]);
}

#[test]
fn out_of_bounds_and_partial_words_are_errors() {
    let (_dev, s) = setup();
    let a = DeviceBuffer::alloc(8, &s).unwrap();
    let bad = |r: Result<()>| assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    bad(a.upload_at(6, &[0; 3], &s));
    bad(a.upload_at(usize::MAX, &[0; 1], &s));
    bad(a.download_at(0, &mut [0; 9], &s));
    bad(a.fill(0, 12, Fill::U8(0), &s));
    bad(a.fill(2, 4, Fill::U32(0), &s));
    bad(a.fill(0, 6, Fill::U32(0), &s));
    bad(a.copy_from(4, &a, 0, 5, &s));
    // Empty ranges at the end are fine.
    a.upload_at(8, &[], &s).unwrap();
}

#[test]
fn a_graph_capture_returns_the_bodys_error_first() {
    let (_dev, s) = setup();
    let e = GpuGraph::capture(&s, || Err(Error::InvalidArgument("body".into())));
    assert!(matches!(e, Err(Error::InvalidArgument(m)) if m == "body"));
    let g = GpuGraph::capture(&s, || Ok(())).unwrap();
    g.launch(&s).unwrap();
}

#[test]
fn the_copy_kernel_takes_three_words_and_refuses_partial_vectors() {
    let (dev, s) = setup();
    let k = CopyKernel::load(&dev).unwrap();
    let (a, b) = (
        DeviceBuffer::zeroed(64, &s).unwrap(),
        DeviceBuffer::zeroed(32, &s).unwrap(),
    );
    take_launches();
    k.copy(&a, &b, 32, 3, &s).unwrap();
    let l = take_launches();
    assert_eq!(l.len(), 1);
    assert_eq!((l[0].kernel, l[0].grid), ("ar_copy_f32x4", 3));
    let words: Vec<u64> = l[0]
        .raw
        .chunks_exact(8)
        .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(words, [a.addr() as u64, b.addr() as u64, 2]);
    assert!(k.copy(&a, &b, 24, 1, &s).is_err());
    assert!(k.copy(&a, &b, 64, 1, &s).is_err());
    assert!(take_launches().is_empty());
}
