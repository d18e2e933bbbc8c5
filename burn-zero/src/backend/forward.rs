//! The one mechanism that implements burn's op traits for `ZeroBackend`: `forward_ops!`.
//!
//! Given a trait name and its signatures (types in brackets, `B` written as `Self`), it
//! implements the trait for `ZeroBackend<B>` with bodies that call the same function of `B`.
//! Arguments and results are converted by their type tokens: float primitives (bare, borrowed,
//! in `Option`/`Vec`, tuples and burn's float-carrying structs) go through
//! [`ZeroTensor`](super::ZeroTensor); all other types are the same for both backends and pass
//! through untouched.

/// Implements one op trait for `ZeroBackend<B>` by forwarding every function to `B`.
macro_rules! forward_ops {
    ($trait:ident; $(fn $name:ident($($arg:ident: [$($arg_ty:tt)*]),* $(,)?) -> [$($ret:tt)*]
        $(=> $(@$raw:ident)? $route:path)?;)*) => {
        impl<B: burn_backend::Backend> $trait<Self> for $crate::backend::ZeroBackend<B> {
            $(
                fn $name($($arg: $($arg_ty)*),*) -> $($ret)* {
                    let out = forward_ops!(@body [$($($raw)?)?] [$($ret)*] [$($route)?]
                        [<B as $trait<B>>::$name] ($($arg [$($arg_ty)*]),*));
                    forward_ops!(@count $name [$($ret)*] out)
                }
            )*
        }
    };

    // `=> @raw path`: the route takes and returns `ZeroBackend`'s own types, unconverted.
    (@body [raw] [$($ret:tt)*] [$route:path] [$($default:tt)*] ($($arg:ident [$($ty:tt)*]),*)) => {
        $route($($arg),*)
    };
    (@body [] [$($ret:tt)*] [$($route:path)?] [$($default:tt)*] ($($arg:ident [$($ty:tt)*]),*)) => {
        forward_ops!(@ret [$($ret)*]
            (forward_ops!(@callee [$($route)?] [$($default)*]))
                ($(forward_ops!(@arg $arg [$($ty)*])),*))
    };

    // The FLOPs profiler (`crate::profile`): a float result of a counted op, while recording.
    (@count $name:ident [FloatTensor<Self>] $out:ident) => {{
        if $crate::profile::recording() && $crate::profile::counted(stringify!($name)) {
            let n = burn_backend::TensorMetadata::shape(&$out).num_elements();
            $crate::profile::record_elements(n as u64);
        }
        $out
    }};
    (@count $name:ident [$($other:tt)*] $out:ident) => { $out };

    // The function called: `B`'s own, or the `=> route` given for it.
    (@callee [] [$($default:tt)*]) => { $($default)* };
    (@callee [$route:path] [$($default:tt)*]) => { $route };

    // Arguments: unwrap float primitives of `ZeroBackend` into those of `B`.
    (@arg $a:ident [FloatTensor<Self>]) => { $a.into_inner() };
    (@arg $a:ident [&FloatTensor<Self>]) => { $a.inner_for_metadata() };
    (@arg $a:ident [Option<FloatTensor<Self>>]) => { $a.map($crate::backend::ZeroTensor::into_inner) };
    (@arg $a:ident [Vec<FloatTensor<Self>>]) => {
        $a.into_iter().map($crate::backend::ZeroTensor::into_inner).collect()
    };
    (@arg $a:ident [TensorPrimitive<Self>]) => { $crate::backend::convert::primitive_in($a) };
    (@arg $a:ident [QuantizationParametersPrimitive<Self>]) => {
        $crate::backend::convert::qparams_in($a)
    };
    (@arg $a:ident [TransactionPrimitive<Self>]) => { $crate::backend::convert::transaction_in($a) };
    (@arg $a:ident [$($other:tt)*]) => { $a };

    // Results: wrap float primitives of `B` into those of `ZeroBackend`.
    (@ret [FloatTensor<Self>] $e:expr) => { $crate::backend::ZeroTensor::local($e) };
    (@ret [TensorPrimitive<Self>] $e:expr) => { $crate::backend::convert::primitive_out($e) };
    (@ret [(FloatTensor<Self>, IntTensor<Self>)] $e:expr) => {{
        let (float, int) = $e;
        ($crate::backend::ZeroTensor::local(float), int)
    }};
    (@ret [(FloatTensor<Self>, FloatTensor<Self>)] $e:expr) => {{
        let (a, b) = $e;
        ($crate::backend::ZeroTensor::local(a), $crate::backend::ZeroTensor::local(b))
    }};
    (@ret [MaxPool1dWithIndices<Self>] $e:expr) => { $crate::backend::convert::max_pool1d_out($e) };
    (@ret [MaxPool2dWithIndices<Self>] $e:expr) => { $crate::backend::convert::max_pool2d_out($e) };
    (@ret [MaxPool1dBackward<Self>] $e:expr) => {
        $crate::backend::convert::max_pool1d_backward_out($e)
    };
    (@ret [MaxPool2dBackward<Self>] $e:expr) => {
        $crate::backend::convert::max_pool2d_backward_out($e)
    };
    (@ret [DeformConv2dBackward<Self>] $e:expr) => {
        $crate::backend::convert::deform_conv2d_backward_out($e)
    };
    (@ret [$($other:tt)*] $e:expr) => { $e };
}

pub(crate) use forward_ops;
